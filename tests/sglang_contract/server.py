"""Contract server: the part of SGLang 0.5.23's HTTP API that hidden-state capture and
acceptance measurement use, computed with a real HF Llama (and Aerie's own EAGLE-3 engine),
with faults on demand. Binds 127.0.0.1 only.

    python -m tests.sglang_contract.server --model DIR --mode final|aux --port P
        [--aux-layer-ids 1 3 4] [--no-hidden-states] [--radix-cache]
        [--chunked-prefill-size N] [--faults JSON] [--endpoint JSON ...]
        [--wait-for-model SECONDS]
        [--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
         [--speculative-num-steps N --speculative-eagle-topk K
          --speculative-num-draft-tokens D] [--decode-log-interval 40]]
        [--launch-fault unhealthy|no_spec|wrong_drafter|lossy|dies]

Each ``--endpoint '{"port": P2, "mode": "aux", ...}'`` adds one more independent server
(own port, flags, faults and counters; keys as the flags, defaults from them) to the same
process, so that tests load the model once for several servers. ``--wait-for-model`` lets
a test start the server (and its slow imports) before the model dir exists: the server
polls until ``DIR`` appears (write it elsewhere and rename it into place).

What it serves, as SGLang does (sources in docs/sglang.md), every answer written by orjson
with SGLang's options:

- ``POST /generate``: ``input_ids`` flat (answer: one object) or nested (answer: a list in
  input order); each object ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "hidden_states"}}``.
  ``hidden_states[0]`` has one row per input token; each further decode step appends one
  row (``max_new_tokens`` - 1 of them; ``max_new_tokens: 0`` returns none). Rows: ``final``
  mode = HF ``hidden_states[-1]`` (after the final norm in transformers 5; checked by the
  tests), ``aux`` mode = ``cat(hidden_states[l + 1] for l in aux ids)``, the un-normalised
  output of decoder layer ``l``. Next tokens are greedy.
- A ``/generate`` that asks for no hidden states decodes as SGLang does without a drafter:
  ``sampling_params`` as in speculative mode below (sampled unless ``temperature`` is 0,
  ``sampling_seed``), stopping at ``max_new_tokens``, EOS and ``stop_token_ids``; no
  speculative keys in ``meta_info``.
- Without the hidden-states flag (``--no-hidden-states``) a request asking for them gets
  SGLang's HTTP 400 ``{"error": {"message": "The server is not configured to return the
  hidden states. ..."}}``. ``--radix-cache`` reuses previously seen prefixes (rows only for
  the uncached suffix, ``cached_tokens`` > 0); ``--chunked-prefill-size N`` keeps only the
  rows of a prompt's last chunk: the two row-dropping misconfigurations.
- ``GET /server_info`` (and ``/get_server_info``): the server-args keys SGLang reports,
  ``internal_states`` (one entry: this server is one DP rank) and ``version``.
  ``GET|POST /flush_cache`` (HTTP 400 while a ``/generate`` is in flight, as SGLang refuses
  to flush a busy scheduler), ``GET /health``, ``GET /health_generate``.

Speculative mode (``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR``,
optionally all three of ``--speculative-num-steps/-eagle-topk/-num-draft-tokens``; none of
them: SGLang's auto choice, a chain's draft tokens adjusted to steps + 1, via
``SpecParams.resolve``): ``/generate`` decodes with Aerie's lossless EAGLE-3 engine
(``pipeline.evaluation.engine.evaluate``) and the drafter ``load_drafter`` reads from DIR on
the served model's embedding. ``sampling_params`` as SGLang reads them: ``temperature``
(default 1.0: sampled, as SGLang), ``top_p``, ``top_k``, ``min_p`` (bad values: HTTP 400);
a sampled request draws from a generator seeded by its ``sampling_seed``, else from the
server's own (SGLang's global RNG). ``return_hidden_states`` gets HTTP 400. Decoding
stops at ``max_new_tokens``, at the model config's ``eos_token_id`` (unless
``ignore_eos``) and at ``stop_token_ids``. ``meta_info`` adds SGLang's speculative keys, only
when the request reached a verify pass (as ``fill_spec_decoding_meta`` does):
``spec_verify_ct`` (verify passes; the prefill token is not one), ``spec_accept_length`` =
``completion_tokens / spec_verify_ct``, ``spec_num_correct_drafts``,
``spec_num_proposed_drafts``, ``spec_accept_rate`` and the aliases ``spec_accepted_drafts``,
``spec_proposed_drafts``. ``finish_reason`` is ``{"type": "length", "length": N}`` or
``{"type": "stop", "matched": id}``. ``internal_states[0].avg_spec_accept_length`` follows
SGLang's scheduler counters: each verify pass adds its emitted tokens (accepted drafts + the
bonus, never the prefill token) and 1 to per-interval sums, which fold into lifetime sums
every ``--decode-log-interval`` decode batches (here one batch = one verify pass, requests
are decoded one at a time); the key is absent while the lifetime count is 0 and
``/flush_cache`` zeroes everything.

Test controls: ``POST /_faults {"kind", "count": k (-1 = always), "every": n, "delay_s"}``
faults the next k ``/generate`` requests (only every n-th). Kinds: ``http500``, ``drop``
(close the socket without an answer), ``garbage`` (non-JSON 200), ``slow`` (answer after
``delay_s`` or at ``/_reset``, whichever comes first), ``short`` (drop the last row),
``nan`` (NaN token in a row, as Python's json writes it), ``null`` (null in a row, as orjson
writes NaN), ``omit_hidden`` (no ``hidden_states``), ``omit_spec`` (no ``spec_verify_ct``),
``short_output`` (drop the last output id); content faults hit the request's first sample.
``--launch-fault`` makes a whole server misbehave from its start, as the engine evaluator's
faults: ``unhealthy`` (``/health`` answers 503), ``no_spec`` (the speculative flags are
ignored), ``wrong_drafter`` (the drafter drafts nothing: every verify pass emits one token),
``lossy`` (greedy speculative outputs end on a token the target did not pick),
``near_tie`` (greedy speculative outputs end on the target's second choice), ``dies`` (the
process exits on its third ``/generate``). A decoding request with ``return_logprob`` and
``top_logprobs_num`` N gets ``meta_info.output_top_logprobs`` (per output token, N
``[logprob, token_id, null]`` best first).
``POST /_reset`` clears faults, counters (speculative ones included) and the prefix cache
and releases slow replies; ``GET /_stats``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import torch

logger = logging.getLogger("sglang_contract")

VERSION = "0.5.23"
# SGLang 0.5.23 answers through orjson with these options (srt/utils/json_response.py):
# floats as their shortest round-trip decimal, NaN and infinities as null
ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
NO_HIDDEN = ("The server is not configured to return the hidden states. "
             "Please set `--enable-return-hidden-states` to enable this feature.")
FAULT_KINDS = frozenset({"http500", "drop", "garbage", "slow", "short", "nan", "null",
                         "omit_hidden", "omit_spec", "short_output"})
# how a launched server misbehaves from its start (the engine evaluator's faults)
LAUNCH_FAULTS = ("unhealthy", "no_spec", "wrong_drafter", "lossy", "near_tie", "dies")
DIES_AT = 3  # "dies": the process exits on this /generate request
SPEC_ALGORITHM = "EAGLE3"  # what aux capture reports, and the default drafter's
# DFLASH: SGLang 0.5.23 forces one step and top-k 1 (speculative_hook.py) and verifies a
# chain of num_draft_tokens (the block, default: the drafter's block_size)
SPEC_ALGORITHMS = ("EAGLE3", "DFLASH")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    count: int = 1
    every: int = 1
    delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS or self.every < 1:
            raise ValueError(f"bad fault spec {self}; kinds: {sorted(FAULT_KINDS)}")


@dataclass(frozen=True)
class EndpointConfig:
    port: int
    mode: str = "final"
    aux_layer_ids: tuple[int, ...] | None = None  # None: EAGLE-3 default, reported as null
    hidden_states: bool = True
    radix_cache: bool = False
    chunked_prefill_size: int = -1
    faults: FaultSpec | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    decode_log_interval: int = 40
    launch_fault: str | None = None  # see --launch-fault

    @property
    def speculative(self) -> bool:
        """Decoding with a draft model (aux capture sets the algorithm without one)."""
        return self.speculative_draft_model_path is not None


class Model:
    """The HF model shared by all endpoints; one forward at a time keeps CPU use bounded."""

    def __init__(self, path: str) -> None:
        from transformers import LlamaForCausalLM

        torch.set_num_threads(1)
        self.path = path
        self.model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self.lock = threading.Lock()  # also held for a whole speculative decode

    def default_aux_ids(self) -> tuple[int, ...]:
        n = self.num_layers
        return (1, n // 2 - 1, n - 4)

    def forward(self, ids: list[int], mode: str, aux_ids: tuple[int, ...]) -> tuple[torch.Tensor,
                                                                                     int]:
        """Rows ``[T, W]`` for every position, and the greedy next token."""
        with self.lock, torch.no_grad():
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        rows = hs[-1][0] if mode == "final" else torch.cat([hs[i + 1][0] for i in aux_ids], -1)
        return rows, int(out.logits[0, -1].argmax())


class SpecDecoder:
    """Aerie's EAGLE-3 engine behind an endpoint, one prompt at a time: with the endpoint's
    drafter (speculative mode), or without one (``drafter`` None: plain decoding, each
    token after the prefill's one forward)."""

    def __init__(self, model: Model, params: Any, drafter: Any) -> None:
        target = model.model
        self.model, self.params, self.drafter = model, params, drafter
        # (steps, topk, draft tokens) as /server_info shows them (SGLang's view)
        self.reported = None if params is None else (params.num_steps, params.eagle_topk,
                                                     params.num_draft_tokens)
        eos = target.config.eos_token_id
        self.eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.vocab = target.config.vocab_size
        self.rng = torch.Generator().manual_seed(0)  # SGLang's global RNG (--random-seed)

    @classmethod
    def for_endpoint(cls, config: EndpointConfig, model: Model) -> SpecDecoder:
        from pipeline.algorithms import algorithm_of_directory, as_drafter, read_config
        from pipeline.eagle3.spec import SpecParams

        target, path = model.model, config.speculative_draft_model_path
        found = algorithm_of_directory(path)
        if found.sglang_algorithm != config.speculative_algorithm:
            raise SystemExit(f"contract server: {path} is a {found.title} drafter, not "
                             f"{config.speculative_algorithm}'s")
        if found.sglang_algorithm == "DFLASH":  # steps and top-k forced to 1
            block = config.speculative_num_draft_tokens or int(read_config(path)["block_size"])
            params = found.from_sglang_reported(1, 1, block)
        else:
            params = SpecParams.resolve(
                config.speculative_num_steps, config.speculative_eagle_topk,
                config.speculative_num_draft_tokens, architecture=target.config.architectures)
        drafter = as_drafter(found.load(path, target.get_input_embeddings().weight.detach(),
                                        head=target.get_output_embeddings().weight.detach()
                                        ).eval())
        if config.launch_fault == "wrong_drafter":  # loads nothing useful: drafts no token
            drafter = None
        decoder = cls(model, params, drafter)
        decoder.reported = found.sglang_reported(params)
        return decoder

    def generate(self, ids: list[int], max_new: int, stop: frozenset[int],
                 sampler: Any, seed: int | None) -> tuple[list[int], list[int]]:
        """(output ids, tokens emitted by each verify pass) of one prompt."""
        out, trace = self.generate_traced(ids, max_new, stop, sampler, seed)
        return out, [len(cycle.emitted) for cycle in trace]

    def top_logprobs(self, ids: list[int], out: list[int], n: int
                     ) -> list[list[tuple[float, int]]]:
        """The ``n`` likeliest tokens with their log-probabilities, best first, at each
        position of ``out`` (the continuation of ``ids``): one cache-free forward."""
        seq = [*ids, *out[:-1]]
        with self.model.lock, torch.inference_mode():
            logits = self.model.model(torch.tensor([seq])).logits[0, len(ids) - 1:]
        values, tokens = torch.log_softmax(logits.float(), -1).topk(n, -1)
        return [[(float(v), int(t)) for v, t in zip(vs, ts, strict=True)]
                for vs, ts in zip(values, tokens, strict=True)]

    def runner_up_last(self, ids: list[int], out: list[int]) -> list[int]:
        """``out`` with its last token replaced by the target's second choice there (the
        ``near_tie`` fault: a divergence at the target's top two)."""
        _, second = self.top_logprobs(ids, out, 2)[-1][1]
        return [*out[:-1], second]

    def generate_traced(self, ids: list[int], max_new: int, stop: frozenset[int],
                        sampler: Any, seed: int | None) -> tuple[list[int], list[Any]]:
        """(output ids, the engine's trace: one ``CycleTrace`` per verify pass)."""
        from pipeline.evaluation.engine import CycleTrace, generate
        from pipeline.evaluation.target import TargetRunner

        trace: list[CycleTrace] = []
        with self.model.lock, torch.inference_mode():
            rng = self.rng if seed is None else torch.Generator().manual_seed(seed)
            aux = self.drafter.aux_layer_ids if self.drafter is not None else ()
            runner = TargetRunner(self.model.model, aux)
            out, _ = generate(runner, self.drafter, ids,
                              self.params if self.drafter is not None else None, max_new,
                              stop, sampler=sampler, generator=rng, trace=trace)
        return out, trace


@dataclass
class SpecCounters:
    """SGLang's scheduler speculative counters (``metrics_reporter``): per-interval sums
    fold into the lifetime sums that ``/server_info`` averages every ``interval`` batches."""

    interval: int = 40
    decode_batches: int = 0
    accept_tokens: int = 0
    forward_ct: int = 0
    total_accept_tokens: int = 0
    total_forward_ct: int = 0

    def add_verify(self, emitted: int) -> None:
        self.accept_tokens += emitted  # accepted drafts + the bonus token
        self.forward_ct += 1
        self.decode_batches += 1
        if self.decode_batches % self.interval == 0:
            self.total_accept_tokens += self.accept_tokens
            self.total_forward_ct += self.forward_ct
            self.accept_tokens = self.forward_ct = 0

    def average(self) -> float | None:
        return (self.total_accept_tokens / self.total_forward_ct if self.total_forward_ct
                else None)


@dataclass
class EndpointState:
    config: EndpointConfig
    faults: FaultSpec | None = None
    fault_clock: int = 0
    injected: int = 0
    generate_requests: int = 0
    samples: int = 0
    prefixes: set[tuple[int, ...]] = field(default_factory=set)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0  # /generate requests in flight
    spec: SpecCounters = field(default_factory=SpecCounters)

    def __post_init__(self) -> None:
        self.spec = SpecCounters(self.config.decode_log_interval)

    def next_fault(self) -> FaultSpec | None:
        with self.lock:
            self.generate_requests += 1
            spec = self.faults
            if spec is None:
                return None
            self.fault_clock += 1
            if self.fault_clock % spec.every or (0 <= spec.count <= self.injected):
                return None
            self.injected += 1
            return spec

    def reset(self) -> None:
        with self.lock:
            self.faults, self.fault_clock, self.injected = None, 0, 0
            self.generate_requests = self.samples = 0
            self.prefixes.clear()
            self.spec = SpecCounters(self.config.decode_log_interval)
            self.release.set()
            self.release = threading.Event()

    def cached_prefix(self, ids: list[int]) -> int:
        """Radix-cache stand-in: longest seen prefix (at most T-1, as SGLang), then remember."""
        with self.lock:
            cached = max((k for k in range(1, len(ids)) if tuple(ids[:k]) in self.prefixes),
                         default=0)
            self.prefixes.update(tuple(ids[:k]) for k in range(1, len(ids) + 1))
        return cached


class ContractHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, config: EndpointConfig, model: Model) -> None:
        self.state = EndpointState(config, faults=config.faults)
        self.model = model
        self.aux_ids = config.aux_layer_ids or model.default_aux_ids()
        top = model.num_layers - 1  # HF hidden_states[N] is post-norm, not a layer output
        if config.mode == "aux" and not all(0 <= i < top for i in self.aux_ids):
            raise SystemExit(f"aux layer ids {self.aux_ids} must lie in [0, {top})")
        self.spec = _spec_decoder(config, model)
        self.plain = SpecDecoder(model, None, None)  # requests without hidden states
        super().__init__(("127.0.0.1", config.port), Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("connection to %s ended badly", client_address, exc_info=True)

    def server_info(self) -> dict[str, Any]:
        c = self.state.config
        aux = c.mode == "aux"
        spec = self.spec.reported if self.spec else None
        internal: dict[str, Any] = {"last_gen_throughput": 0.0}
        with self.state.lock:
            average = self.state.spec.average()
        if self.spec and average is not None:
            internal["avg_spec_accept_length"] = average
        return {"model_path": self.model.path, "version": VERSION, "contract_server": True,
                "speculative_draft_model_path": c.speculative_draft_model_path,
                "speculative_num_steps": spec[0] if spec else None,
                "speculative_eagle_topk": spec[1] if spec else None,
                "speculative_num_draft_tokens": spec[2] if spec else None,
                "decode_log_interval": c.decode_log_interval,
                "internal_states": [internal],
                "enable_return_hidden_states": c.hidden_states,
                "return_hidden_states_mode": "full" if c.hidden_states else None,
                "disable_radix_cache": not c.radix_cache,
                "chunked_prefill_size": c.chunked_prefill_size,
                "speculative_algorithm": c.speculative_algorithm or (SPEC_ALGORITHM if aux
                                                                      else None),
                "enable_return_aux_hidden_states": aux,
                "return_aux_hidden_state_layer_ids": (list(c.aux_layer_ids) if aux and
                                                      c.aux_layer_ids else None)}

    def generate_one(self, ids: list[int], max_new: int) -> tuple[list[Any], list[int], int]:
        """(hidden_states blocks, output ids, cached tokens) of one prompt."""
        c = self.state.config
        rows, token = self.model.forward(ids, c.mode, self.aux_ids)
        cached = self.state.cached_prefix(ids) if c.radix_cache else 0
        start = cached
        if c.chunked_prefill_size > 0:
            start = max(start, (len(ids) - 1) // c.chunked_prefill_size * c.chunked_prefill_size)
        blocks: list[Any] = [rows[start:].tolist()]
        out = [token] if max_new > 0 else []
        seq = list(ids)
        for _ in range(max_new - 1):
            seq.append(out[-1])
            step_rows, token = self.model.forward(seq, c.mode, self.aux_ids)
            blocks.append(step_rows[-1].tolist())
            out.append(token)
        return (blocks if max_new > 0 else []), out, cached


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ContractHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        logger.debug(format, *args)

    def _send(self, status: int, body: Any, raw: bytes | None = None) -> None:
        data = raw if raw is not None else orjson.dumps(body, option=ORJSON_OPTIONS)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return json.loads(raw) if raw else {}

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        state = self.server.state
        if self.path in ("/health", "/health_generate"):
            if state.config.launch_fault == "unhealthy":
                self._send(503, None, raw=b"")
            else:
                self._send(200, None, raw=b"")
        elif self.path in ("/server_info", "/get_server_info"):
            self._send(200, self.server.server_info())
        elif self.path == "/flush_cache":
            self._flush()
        elif self.path == "/_stats":
            with state.lock:
                self._send(200, {"generate_requests": state.generate_requests,
                                 "samples": state.samples, "faults_injected": state.injected})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        try:
            body = self._body()
        except ValueError as e:
            self._send(400, {"error": {"message": f"invalid JSON: {e}"}})
            return
        state = self.server.state
        if self.path == "/generate":
            self._generate(body)
        elif self.path == "/flush_cache":
            self._flush()
        elif self.path == "/_faults":
            try:
                spec = FaultSpec(**body)
            except (TypeError, ValueError) as e:
                self._send(400, {"error": {"message": str(e)}})
                return
            with state.lock:
                state.faults, state.fault_clock, state.injected = spec, 0, 0
            self._send(200, {"ok": True})
        elif self.path == "/_reset":
            state.reset()
            self._send(200, {"ok": True})
        else:
            self._send(404, {"detail": "Not Found"})

    def _flush(self) -> None:
        state = self.server.state
        with state.lock:
            busy = state.active > 0
            if not busy:
                state.prefixes.clear()
                state.spec = SpecCounters(state.config.decode_log_interval)
        if busy:  # SGLang flushes only an idle scheduler
            self._send(400, None, raw=b"Flush cache failed.\n")
        else:
            self._send(200, None, raw=b"Cache flushed.\n")

    def _generate(self, body: Any) -> None:
        state = self.server.state
        with state.lock:
            state.active += 1
        try:
            self._generate_tracked(body)
        finally:
            with state.lock:
                state.active -= 1

    def _generate_tracked(self, body: Any) -> None:
        state = self.server.state
        fault = state.next_fault()
        kind = fault.kind if fault else None
        if state.config.launch_fault == "dies" and state.generate_requests >= DIES_AT:
            logger.error("launch fault 'dies': exiting mid-evaluation")
            os._exit(3)
        if kind == "http500":
            self._send(500, {"error": {"message": "injected fault: internal server error"}})
            return
        if kind == "drop":
            self.close_connection = True
            return
        if kind == "garbage":
            self._send(200, None, raw=b'{"meta_info": [truncated')
            return
        if kind == "slow":
            state.release.wait(fault.delay_s)
        ids = body.get("input_ids") if isinstance(body, dict) else None
        single = isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        batch = [ids] if single else ids
        if (not isinstance(batch, list) or not batch
                or not all(isinstance(s, list) and s and all(isinstance(t, int) for t in s)
                           for s in batch)):
            self._send(400, {"error": {"message": "input_ids must be a non-empty list of ints "
                                                  "or of such lists"}})
            return
        want = body.get("return_hidden_states", False)
        want_hidden = any(want) if isinstance(want, list) else bool(want)
        if want_hidden and not state.config.hidden_states:
            self._send(400, {"error": {"message": NO_HIDDEN}})
            return
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        if self.server.spec is not None:
            self._speculate(batch, single, params, max_new, want_hidden, kind)
            return
        if not want_hidden:  # SGLang decodes: sampled by default, stopping at EOS
            top_n = body.get("top_logprobs_num") if body.get("return_logprob") else None
            self._decode(batch, single, {**params, "_top_logprobs_num": top_n}, max_new)
            return
        outputs = []
        for n, ids_i in enumerate(batch):
            blocks, out_ids, cached = self.server.generate_one(ids_i, max_new)
            meta: dict[str, Any] = {
                "id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": max_new},
                "prompt_tokens": len(ids_i), "completion_tokens": len(out_ids),
                "cached_tokens": cached}
            if want_hidden and blocks:
                if n == 0:
                    _content_fault(kind, blocks[0])
                if not (n == 0 and kind == "omit_hidden"):
                    meta["hidden_states"] = blocks
            outputs.append({"text": "", "output_ids": out_ids, "meta_info": meta})
        with state.lock:
            state.samples += len(batch)
        answer = outputs[0] if single else outputs
        try:  # "nan": a server whose JSON writer keeps NaN (Python's json), not orjson's null
            self._send(200, answer, raw=json.dumps(answer).encode() if kind == "nan" else None)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client left before the answer (slow reply)")


    def _sampling(self, decoder: SpecDecoder, params: dict[str, Any], max_new: int,
                  want_hidden: bool) -> tuple[Any, frozenset[int]] | None:
        """(sampler, stop tokens) of a decoding request as SGLang reads them; None after
        answering HTTP 400."""
        from pipeline.sampling import FIELDS, SamplingError, SamplingParams

        try:
            sampler = SamplingParams.from_mapping(
                {"temperature": 1.0} | {k: params[k] for k in FIELDS if k in params})
        except SamplingError as e:
            sampler, problem = None, str(e)
        else:
            problem = ("contract server: no hidden states with speculative decoding"
                       if want_hidden else "max_new_tokens must be >= 1" if max_new < 1
                       else None)
        if problem:
            self._send(400, {"error": {"message": problem}})
            return None
        stop = frozenset(int(t) for t in params.get("stop_token_ids") or ())
        if not params.get("ignore_eos"):
            stop |= decoder.eos
        return sampler, stop

    def _decode(self, batch: list[list[int]], single: bool, params: dict[str, Any],
                max_new: int) -> None:
        """Plain decoding (no drafter, no hidden states), as SGLang's /generate."""
        decoder = self.server.plain
        got = self._sampling(decoder, params, max_new, False)
        if got is None:
            return
        sampler, stop = got
        outputs = []
        top_n = int(body_top_n) if (body_top_n := params.get("_top_logprobs_num")) else 0
        for ids in batch:
            out, _ = decoder.generate(ids, max_new, stop, sampler, params.get("sampling_seed"))
            finish = ({"type": "length", "length": max_new} if len(out) >= max_new
                      else {"type": "stop", "matched": out[-1]})
            meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(ids),
                    "completion_tokens": len(out), "cached_tokens": 0}
            if top_n:  # SGLang: per output token, [logprob, token_id, text] best first
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in top]
                                               for top in decoder.top_logprobs(ids, out, top_n)]
            outputs.append({"text": "", "output_ids": out, "meta_info": meta})
        with self.server.state.lock:
            self.server.state.samples += len(batch)
        self._send(200, outputs[0] if single else outputs)

    def _speculate(self, batch: list[list[int]], single: bool, params: dict[str, Any],
                   max_new: int, want_hidden: bool, kind: str | None) -> None:
        spec, state = self.server.spec, self.server.state
        assert spec is not None
        got = self._sampling(spec, params, max_new, want_hidden)
        if got is None:
            return
        sampler, stop = got
        d = spec.params.num_draft_tokens
        outputs = []
        for n, ids in enumerate(batch):
            out, per_verify = spec.generate(ids, max_new, stop, sampler,
                                            params.get("sampling_seed"))
            with state.lock:
                for emitted in per_verify:
                    state.spec.add_verify(emitted)
            finish = ({"type": "length", "length": max_new} if len(out) >= max_new
                      else {"type": "stop", "matched": out[-1]})
            meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": finish,
                                    "prompt_tokens": len(ids), "completion_tokens": len(out),
                                    "cached_tokens": 0}
            verify = len(per_verify)
            if verify:  # fill_spec_decoding_meta skips requests that never verified
                correct = len(out) - 1 - verify
                meta.update(spec_verify_ct=verify, spec_accept_length=len(out) / verify,
                            spec_num_correct_drafts=correct, spec_accepted_drafts=correct,
                            spec_num_proposed_drafts=verify * (d - 1),
                            spec_proposed_drafts=verify * (d - 1),
                            spec_accept_rate=correct / (verify * (d - 1)))
            if n == 0 and kind == "omit_spec":
                meta.pop("spec_verify_ct", None)
            if n == 0 and kind == "short_output":
                out = out[:-1]
            if state.config.launch_fault == "lossy" and sampler.greedy and len(out) > 1:
                out = [*out[:-1], (out[-1] + 1) % spec.vocab]  # not what the target decodes
            if state.config.launch_fault == "near_tie" and sampler.greedy and len(out) > 1:
                out = spec.runner_up_last(ids, out)
            outputs.append({"text": "", "output_ids": out, "meta_info": meta})
        with state.lock:
            state.samples += len(batch)
        try:
            self._send(200, outputs[0] if single else outputs)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client left before the answer")


def _spec_decoder(config: EndpointConfig, model: Model) -> SpecDecoder | None:
    """The engine of a speculative endpoint; None for the others. Bad flags exit."""
    numbers = (config.speculative_num_steps, config.speculative_eagle_topk,
               config.speculative_num_draft_tokens)
    if config.speculative_algorithm not in (None, *SPEC_ALGORITHMS):
        raise SystemExit(f"contract server: --speculative-algorithm "
                         f"{config.speculative_algorithm} is not served (only "
                         f"{', '.join(SPEC_ALGORITHMS)})")
    if not config.speculative:
        if any(v is not None for v in numbers):
            raise SystemExit("--speculative-num-* need --speculative-draft-model-path")
        return None
    if config.speculative_algorithm is None:
        raise SystemExit("--speculative-draft-model-path needs --speculative-algorithm")
    if config.mode != "final":
        raise SystemExit("contract server: speculative decoding with aux capture is not served")
    if config.decode_log_interval < 1:
        raise SystemExit("--decode-log-interval must be >= 1")
    return SpecDecoder.for_endpoint(config, model)


def _content_fault(kind: str | None, prefill: list[list[float]]) -> None:
    if kind == "short":
        prefill.pop()
    elif kind in ("nan", "null"):
        prefill[len(prefill) // 2][0] = float("nan") if kind == "nan" else None


def parse_args(argv: list[str] | None = None) -> tuple[list[EndpointConfig], str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF LlamaForCausalLM checkpoint dir")
    p.add_argument("--mode", choices=("final", "aux"), default="final")
    p.add_argument("--port", type=int, help="port of the first endpoint")
    p.add_argument("--aux-layer-ids", type=int, nargs="+")
    p.add_argument("--no-hidden-states", action="store_true")
    p.add_argument("--radix-cache", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=-1)
    p.add_argument("--faults", type=json.loads, help="a FaultSpec as JSON")
    p.add_argument("--endpoint", type=json.loads, action="append", default=[],
                   help="one more endpoint as JSON (port, mode, aux_layer_ids, hidden_states, "
                        "radix_cache, chunked_prefill_size, faults, speculative_algorithm, "
                        "speculative_draft_model_path, speculative_num_steps, "
                        "speculative_eagle_topk, speculative_num_draft_tokens, "
                        "decode_log_interval)")
    p.add_argument("--wait-for-model", type=float, default=0.0, metavar="SECONDS",
                   help="poll this long for the model dir to appear")
    p.add_argument("--speculative-algorithm", help="EAGLE3 or DFLASH")
    p.add_argument("--speculative-draft-model-path", help="an Aerie drafter dir of it")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--decode-log-interval", type=int, default=40,
                   help="decode batches between folds of the accept-length counters")
    p.add_argument("--launch-fault", choices=LAUNCH_FAULTS,
                   help="misbehave from the start: unhealthy (/health 503), no_spec (ignore "
                        "the speculative flags), wrong_drafter (draft nothing: τ = 1), lossy "
                        "(greedy speculative outputs differ from the target's), dies (exit "
                        f"on /generate request {DIES_AT})")
    args = p.parse_args(argv)
    if args.launch_fault == "no_spec":
        args.speculative_algorithm = args.speculative_draft_model_path = None
        args.speculative_num_steps = args.speculative_eagle_topk = None
        args.speculative_num_draft_tokens = None
    base = EndpointConfig(
        port=args.port or 0, mode=args.mode,
        aux_layer_ids=tuple(args.aux_layer_ids) if args.aux_layer_ids else None,
        hidden_states=not args.no_hidden_states, radix_cache=args.radix_cache,
        chunked_prefill_size=args.chunked_prefill_size,
        faults=FaultSpec(**args.faults) if args.faults else None,
        speculative_algorithm=args.speculative_algorithm,
        speculative_draft_model_path=args.speculative_draft_model_path,
        speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=args.speculative_eagle_topk,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        decode_log_interval=args.decode_log_interval, launch_fault=args.launch_fault)
    configs = [base] if args.port else []
    for extra in args.endpoint:
        extra = dict(extra)
        if extra.get("aux_layer_ids") is not None:
            extra["aux_layer_ids"] = tuple(extra["aux_layer_ids"])
        if extra.get("faults") is not None:
            extra["faults"] = FaultSpec(**extra["faults"])
        configs.append(replace(base, **extra))
    if not configs or any(c.port <= 0 for c in configs):
        p.error("give --port and/or --endpoint with a port")
    return configs, args.model, args.wait_for_model


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    configs, model_dir, wait_s = parse_args(argv)
    import transformers  # noqa: F401 (the slow import, before waiting for the model)

    deadline = time.monotonic() + wait_s
    while not Path(model_dir).is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    model = Model(model_dir)
    servers = [ContractHTTPServer(c, model) for c in configs]
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    logger.info("serving %s on 127.0.0.1", [(c.mode, c.port, c.speculative) for c in configs])
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
