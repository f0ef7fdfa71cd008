"""A stand-in for the part of vLLM 0.33's OpenAI server that the ``vllm`` evaluator uses,
decoding with a real HF Llama and Aerie's EAGLE-3 engine (as the SGLang contract server
does). Binds 127.0.0.1 only.

    python -m tests.vllm_contract.completions_server MODEL --port P
        [--speculative-config JSON] [--per-request-spec-decode-metrics none|summary|detailed]
        [--launch-fault unhealthy|no_spec|wrong_drafter|lossy|dies]

As vLLM 0.33 (``vllm serve``; sources in docs/vllm.md):

- ``--speculative-config`` parsed strictly (:func:`tests.vllm_contract.server.
  speculative_drafter`): EAGLE-3 or DFlash drafted as a chain of
  ``num_speculative_tokens``.
  ``--per-request-spec-decode-metrics`` other than ``none`` without it stops the server at
  start.
- ``GET /health`` (200, empty), ``GET /version`` (``{"version": "0.33.0"}``), ``GET
  /v1/models`` (the served model's id is the MODEL argument); ``/server_info`` only under
  ``VLLM_SERVER_DEV_MODE=1`` (``?config_format=json``: ``vllm_config.speculative_config``).
- ``POST /v1/completions``: ``model`` must name the served model (else 404); ``prompt`` a
  list of token ids; ``max_tokens`` (default 16), ``temperature``/``top_p``/``top_k``/
  ``min_p`` (unset: 1.0, 1.0, all, 0; 0 or -1 ``top_k``: all), ``seed``, ``stop_token_ids``,
  ``ignore_eos``, ``n`` (1 only here), ``return_token_ids``, ``logprobs`` N (with
  ``return_tokens_as_token_ids``: ``choices[0].logprobs.top_logprobs``, per output token
  ``{"token_id:ID": logprob}`` of the N likeliest). Decoding stops at
  ``max_tokens``, EOS (unless ``ignore_eos``) and ``stop_token_ids``. The answer:
  ``choices[0]`` with ``token_ids`` (null without ``return_token_ids``), ``finish_reason``
  ``length``/``stop``, ``usage``, and a top-level ``metrics`` that is null unless the
  server speculates with per-request metrics on: then ``metrics.speculative_decoding``
  holds ``num_spec_steps`` (verify passes), ``num_accepted_draft_tokens`` (counted before
  the stop trim, as vLLM's scheduler does), ``num_draft_tokens``, ``num_spec_tokens``,
  ``mean_acceptance_length`` (1 + accepted / steps, 1.0 without steps),
  ``draft_acceptance_rate``, ``acceptance_histogram`` (k + 1 entries), and
  ``per_step_accepted``/``per_step_drafted`` (null in ``summary``).
- ``--launch-fault``: as the SGLang contract server's (``unhealthy``: ``/health`` 503;
  ``no_spec``: the speculative flags are ignored; ``wrong_drafter``: no draft token is ever
  accepted; ``lossy``: greedy speculative outputs end on a token the target did not pick;
  ``near_tie``: they end on the target's second choice; ``dies``: the process exits on its
  third completion).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

import torch

from tests.sglang_contract.server import LAUNCH_FAULTS, Model, SpecDecoder
from tests.vllm_contract.server import speculative_drafter

logger = logging.getLogger("vllm_completions_contract")
VERSION = "0.33.0"
DIES_AT = 3


class CompletionsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, model_id: str, model: Model, spec: SpecDecoder | None,
                 metrics: str, fault: str | None, spec_json: str | None) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.model_id, self.model, self.spec, self.metrics = model_id, model, spec, metrics
        self.plain = SpecDecoder(model, None, None)
        self.fault, self.spec_json = fault, spec_json
        self.requests = 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CompletionsServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        logger.debug(format, *args)

    def _send(self, status: int, body: Any) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        url = urlparse(self.path)
        s = self.server
        if url.path == "/health":
            self._send(503 if s.fault == "unhealthy" else 200, None)
        elif url.path == "/version":
            self._send(200, {"version": VERSION})
        elif url.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{
                "id": s.model_id, "object": "model", "owned_by": "vllm", "root": s.model_id,
                "max_model_len": s.model.model.config.max_position_embeddings}]})
        elif url.path == "/server_info" and os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
            spec = json.loads(s.spec_json) if s.spec is not None and s.spec_json else None
            self._send(200, {"vllm_config": {"speculative_config": spec}})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError as e:
            self._send(400, {"error": {"message": f"invalid JSON: {e}"}})
            return
        if urlparse(self.path).path != "/v1/completions":
            self._send(404, {"detail": "Not Found"})
            return
        s = self.server
        with s.lock:
            s.requests += 1
            if s.fault == "dies" and s.requests >= DIES_AT:
                logger.error("launch fault 'dies': exiting mid-evaluation")
                os._exit(3)
        self._complete(body)

    def _complete(self, body: dict[str, Any]) -> None:
        from pipeline.sampling import SamplingError, SamplingParams

        s = self.server
        if body.get("model") != s.model_id:
            self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not "
                                                  f"exist.", "type": "NotFoundError"}})
            return
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt \
                or not all(isinstance(t, int) and t >= 0 for t in prompt) \
                or int(body.get("n") or 1) != 1:
            self._send(400, {"error": {"message": "this stand-in serves one prompt of token "
                                                  "ids with n 1"}})
            return
        top_k = body.get("top_k")
        try:
            sampler = SamplingParams.from_mapping({
                "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
                "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
                "top_k": -1 if top_k in (None, 0) else top_k,
                "min_p": body.get("min_p") or 0.0})
        except SamplingError as e:
            self._send(400, {"error": {"message": str(e)}})
            return
        max_new = int(body.get("max_tokens") or 16)
        decoder = s.spec if s.spec is not None else s.plain
        stop = frozenset(int(t) for t in body.get("stop_token_ids") or ())
        if not body.get("ignore_eos"):
            stop |= decoder.eos
        out, trace = decoder.generate_traced(prompt, max_new, stop, sampler, body.get("seed"))
        if s.spec is not None and s.fault == "lossy" and sampler.greedy and len(out) > 1:
            out = [*out[:-1], (out[-1] + 1) % decoder.vocab]
        if s.spec is not None and s.fault == "near_tie" and sampler.greedy and len(out) > 1:
            out = decoder.runner_up_last(prompt, out)
        logprobs = None
        if body.get("logprobs"):  # vLLM: the top N per output token (ids as "token_id:N")
            as_ids = body.get("return_tokens_as_token_ids")
            logprobs = {"top_logprobs": [
                {(f"token_id:{t}" if as_ids else str(t)): lp for lp, t in top}
                for top in decoder.top_logprobs(prompt, out, int(body["logprobs"]))]}
        stopped = len(out) < max_new or out[-1] in stop
        choice = {"index": 0, "text": "", "logprobs": logprobs,
                  "finish_reason": "stop" if stopped else "length",
                  "stop_reason": out[-1] if stopped and out[-1] in stop else None,
                  "token_ids": out if body.get("return_token_ids") else None,
                  "prompt_token_ids": prompt if body.get("return_token_ids") else None}
        self._send(200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                         "created": int(time.time()), "model": s.model_id,
                         "choices": [choice],
                         "usage": {"prompt_tokens": len(prompt),
                                   "completion_tokens": len(out),
                                   "total_tokens": len(prompt) + len(out)},
                         "metrics": self._metrics(trace)})

    def _metrics(self, trace: list[Any]) -> dict[str, Any] | None:
        s = self.server
        if s.spec is None or s.metrics == "none":
            return None
        k = s.spec.params.num_steps
        accepted = [len(cycle.path) - 1 for cycle in trace]  # before the stop trim
        histogram = [accepted.count(j) for j in range(k + 1)]
        steps, total = len(accepted), sum(accepted)
        detailed = s.metrics == "detailed"
        return {"speculative_decoding": {
            "num_spec_steps": steps, "num_accepted_draft_tokens": total,
            "num_draft_tokens": steps * k, "num_spec_tokens": k,
            "mean_acceptance_length": 1.0 + total / steps if steps else 1.0,
            "draft_acceptance_rate": total / (steps * k) if steps else 0.0,
            "acceptance_histogram": histogram,
            "per_step_accepted": accepted if detailed else None,
            "per_step_drafted": [k] * steps if detailed else None}}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF LlamaForCausalLM checkpoint dir (the served model id)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--speculative-config")
    p.add_argument("--per-request-spec-decode-metrics", default="none",
                   choices=("none", "summary", "detailed"))
    p.add_argument("--launch-fault", choices=LAUNCH_FAULTS)
    args = p.parse_args(argv)
    spec_json = None if args.launch_fault == "no_spec" else args.speculative_config
    metrics = "none" if args.launch_fault == "no_spec" else args.per_request_spec_decode_metrics
    if metrics != "none" and not spec_json:
        raise SystemExit("ValueError: --per-request-spec-decode-metrics needs speculative "
                         "decoding (--speculative-config)")
    torch.set_num_threads(1)
    model = Model(args.model)
    spec = None
    if spec_json:
        from pipeline.algorithms import algorithm_of_directory, as_drafter
        from pipeline.eagle3.spec import SpecParams

        drafter_dir, k = speculative_drafter(spec_json)
        target = model.model
        drafter = as_drafter(algorithm_of_directory(drafter_dir).load(
            drafter_dir, target.get_input_embeddings().weight.detach(),
            head=target.get_output_embeddings().weight.detach()).eval())
        spec = SpecDecoder(model, SpecParams(k, 1, k + 1),
                           None if args.launch_fault == "wrong_drafter" else drafter)
    server = CompletionsServer(args.port, args.model, model, spec, metrics, args.launch_fault,
                               spec_json)
    logger.info("serving %s on 127.0.0.1:%d (speculative: %s)", args.model, args.port,
                spec is not None)
    server.serve_forever()


if __name__ == "__main__":
    main()
