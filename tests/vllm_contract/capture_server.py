"""A stand-in for vLLM 0.33's hidden-state export (``extract_hidden_states``), over HTTP.

``python -m tests.vllm_contract.capture_server MODEL_DIR --port P --speculative-config J
--kv-transfer-config J [--dtype auto] [--api-key K]``

It honours what vLLM 0.33.0 does (docs/vllm.md cites the source):

- ``--speculative-config``: ``method`` must be ``extract_hidden_states``,
  ``num_speculative_tokens`` 1, and ``draft_model_config.hf_config.
  eagle_aux_hidden_state_layer_ids`` a non-empty list; ids are sorted and de-duplicated.
- ``--kv-transfer-config``: ``kv_connector`` ``ExampleHiddenStatesConnector``, ``kv_role``
  ``kv_producer``; extra config ``shared_storage_path`` (default ``/tmp``),
  ``allow_custom_save_path`` (default false: a custom path is ignored, the default
  ``<dir>/<request id>.safetensors`` used), ``use_synchronization_lock`` (default true).
- Id ``k`` is the input of decoder layer ``k`` (id 0: the embeddings); id
  ``num_hidden_layers`` is the last layer's output before the final norm. Computed with the
  real model in ``--dtype`` (``auto``: the config's dtype, float32 downcast to bfloat16).
- ``POST /v1/completions`` (``prompt``: token ids, or a list of them; ``max_tokens``;
  top-level ``kv_transfer_params``) answers with greedy tokens and a top-level
  ``kv_transfer_params: {"hidden_states_path": <first prompt's file>}``. Rows: the prompt's
  tokens, or ``prompt + output[:-1]`` with ``include_output_tokens``. The lock file is
  created and held (``LOCK_EX``) before the answer; the data file is written after it, by
  another thread, then the lock released. ``{"hidden_states", "token_ids" int64}`` with
  safetensors; nothing is ever deleted.
- ``GET /health``, ``GET /version``, ``GET /v1/models``; ``--api-key`` needs a bearer token.

Test-only ``POST /_contract/fault {"kind", "count"}`` plants a fault in the next ``count``
requests: ``missing`` (no file), ``short`` (one row and id fewer), ``dtype`` (float8 e4m3
states), ``layers`` (launched without the last layer's id), ``timeout`` (no answer until the
client gives up), ``ids`` (token ids of another prompt), ``unlocked`` (no lock file; the
data file written after the answer), ``default_path`` (as without
``allow_custom_save_path``), ``no_export`` (as without the connector: no
``kv_transfer_params``, no file), ``slow_write`` (the file written 1 s after the answer,
the lock held until then). ``GET /_contract/stats``: requests served, files written.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

VERSION = "0.33.0"
FAULTS = ("missing", "short", "dtype", "layers", "timeout", "ids", "unlocked", "default_path",
          "no_export", "slow_write")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--speculative-config", "--speculative_config", required=True)
    p.add_argument("--kv-transfer-config", "--kv_transfer_config", required=True)
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16",
                                                       "float32"))
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--api-key", default=None)
    return p.parse_args(argv)


@dataclass(frozen=True)
class Launch:
    """The launch flags that matter, checked as vLLM checks them."""

    layer_ids: list[int]
    storage: str
    custom_paths: bool
    use_lock: bool


def check_launch(args: argparse.Namespace) -> Launch:
    spec = json.loads(args.speculative_config)
    if spec.get("method") != "extract_hidden_states":
        raise SystemExit(f"speculative method {spec.get('method')!r} exports nothing")
    if spec.get("num_speculative_tokens") != 1:
        raise SystemExit("extract_hidden_states needs num_speculative_tokens == 1")
    ids = spec.get("draft_model_config", {}).get("hf_config", {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise SystemExit("eagle_aux_hidden_state_layer_ids must be a non-empty list")
    kv = json.loads(args.kv_transfer_config)
    if (kv.get("kv_connector"), kv.get("kv_role")) != ("ExampleHiddenStatesConnector",
                                                      "kv_producer"):
        raise SystemExit(f"unsupported kv_transfer_config {kv}")
    extra = kv.get("kv_connector_extra_config", {})
    return Launch(sorted(set(int(i) for i in ids)), extra.get("shared_storage_path", "/tmp"),
                  bool(extra.get("allow_custom_save_path", False)),
                  bool(extra.get("use_synchronization_lock", True)))


class Extractor:
    """The model and the launch configuration."""

    def __init__(self, args: argparse.Namespace):
        launch = check_launch(args)
        self.storage, self.custom_paths = launch.storage, launch.custom_paths
        self.use_lock, self.layer_ids = launch.use_lock, launch.layer_ids
        self.model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        n = self.model.config.num_hidden_layers
        if not all(0 <= i <= n for i in self.layer_ids):
            raise SystemExit(f"layer ids {self.layer_ids} outside [0, {n}]")
        dtype = args.dtype
        if dtype == "auto":
            dtype = str(self.model.dtype).removeprefix("torch.")
            dtype = "bfloat16" if dtype == "float32" else dtype
        self.model.to(getattr(torch, dtype))
        self.name = args.model
        self.fault, self.faults_left = None, 0
        self.served = self.written = 0
        self.lock = threading.Lock()
        self.forward_lock = threading.Lock()  # hooks on one shared model: one forward at a time

    def plant(self, kind: str | None, count: int) -> None:
        if kind is not None and kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        with self.lock:
            self.fault, self.faults_left = kind, count if kind else 0

    def take_fault(self) -> str | None:
        with self.lock:
            self.served += 1
            if self.faults_left > 0:
                self.faults_left -= 1
                return self.fault
            return None

    def states(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """``[T, layers, H]`` in vLLM's numbering, and the greedy next token."""
        with self.forward_lock, torch.inference_mode():
            return self._states(ids)

    def _states(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        layers = self.model.model.layers
        recorded: dict[int, torch.Tensor] = {}
        hooks = [layers[0].register_forward_pre_hook(
            lambda _m, args, kwargs: recorded.__setitem__(
                0, (args[0] if args else kwargs["hidden_states"])[0].clone()),
            with_kwargs=True)]
        for k, layer in enumerate(layers):
            hooks.append(layer.register_forward_hook(
                lambda _m, _a, out, k=k: recorded.__setitem__(
                    k + 1, (out[0] if isinstance(out, tuple) else out)[0].clone())))
        try:
            logits = self.model(torch.tensor([ids])).logits
        finally:
            for h in hooks:
                h.remove()
        return torch.stack([recorded[i] for i in self.layer_ids], dim=1), int(
            logits[0, -1].argmax())


def handler(ex: Extractor, api_key: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if not self._authorised():
                return
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/version":
                self._send(200, {"version": VERSION})
            elif self.path == "/_contract/stats":
                self._send(200, {"served": ex.served, "written": ex.written})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": ex.name, "object": "model",
                                                             "root": ex.name}]})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not self._authorised():
                return
            if self.path == "/_contract/fault":
                ex.plant(body.get("kind"), int(body.get("count", 1)))
                self._send(200, {})
                return
            if self.path != "/v1/completions":
                self._send(404, {"detail": "Not Found"})
                return
            prompts = body["prompt"]
            prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
            params = body.get("kv_transfer_params") or {}
            fault = ex.take_fault()
            if fault == "timeout":
                threading.Event().wait(3600)  # never answers; the client gives up
            paths, texts, writes = [], [], []
            for i, ids in enumerate(prompts):
                path, out, write = self._prepare(ids, int(body.get("max_tokens", 16)),
                                                 params, i, fault)
                paths.append(path)
                texts.append(out)
                writes.append(write)
            answer = {
                "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": ex.name,
                "choices": [{"index": i, "text": "", "token_ids": out, "finish_reason": "length"}
                            for i, out in enumerate(texts)],
                "usage": {"prompt_tokens": sum(map(len, prompts))}}
            if fault != "no_export":
                answer["kv_transfer_params"] = {"hidden_states_path": paths[0]}
            try:
                self._send(200, answer)
            finally:  # after the answer, as vLLM's writer threads may, and whether or not
                # the answer reached the client: vLLM's connector saves in the model
                # runner, which knows nothing of the HTTP connection
                for write in writes:
                    threading.Thread(target=write).start()

        def _prepare(self, ids, max_tokens, params, index, fault):
            default = os.path.join(ex.storage, f"cmpl-{uuid.uuid4().hex}-{index}.safetensors")
            custom = params.get("hidden_states_path") if index == 0 else None
            path = custom if custom and ex.custom_paths and fault != "default_path" else default
            out: list[int] = []
            seq = list(ids)
            prompt_states = None
            for _ in range(max(1, max_tokens)):
                states, token = ex.states(seq)
                prompt_states = states if prompt_states is None else prompt_states
                out.append(token)
                seq.append(token)
            rows = seq[:-1] if params.get("include_output_tokens") else list(ids)
            states = prompt_states if rows == list(ids) else ex.states(rows)[0]
            token_ids = torch.tensor(rows, dtype=torch.long)
            if fault == "short":
                states, token_ids = states[:-1], token_ids[:-1]
            elif fault == "dtype":
                states = states.to(torch.float8_e4m3fn)
            elif fault == "layers":
                states = states[:, :-1]
            elif fault == "ids":
                token_ids = torch.flip(token_ids, [0]) + 1
            lock_fd = None
            if fault == "no_export":  # no connector: nothing is saved
                return path, out, lambda: None
            if ex.use_lock and fault != "unlocked":
                os.makedirs(os.path.dirname(path), exist_ok=True)
                lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            tensors = {"hidden_states": states.contiguous(), "token_ids": token_ids}

            def write():
                try:
                    if fault == "slow_write":
                        threading.Event().wait(1.0)
                    if fault != "missing":
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        save_file(tensors, path)
                        with ex.lock:
                            ex.written += 1
                finally:
                    if lock_fd is not None:
                        os.close(lock_fd)

            return path, out, write

    return Handler


def main(argv=None) -> None:
    args = parse_args(argv)
    ex = Extractor(args)
    Path(ex.storage).mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer((args.host, args.port), handler(ex, args.api_key))
    server.daemon_threads = True
    print(f"serving on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
