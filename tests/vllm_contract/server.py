"""A stand-in for the parts of vLLM 0.33's OpenAI server that serving a drafter touches.

It honours, as vLLM does (``vllm serve`` with ``--speculative-config`` and
``--worker-extension-cls``; routes of ``entrypoints/rl/online`` and ``serve/dev``):

- ``--speculative-config`` JSON parsed strictly: ``method`` must be ``eagle3``, ``model`` a
  drafter directory, ``num_speculative_tokens`` > 0; unknown keys are an error (vLLM's
  config classes forbid extras).
- ``--worker-extension-cls``: the class is imported by name and mixed into each worker;
  ``--tensor-parallel-size`` workers.
- Each worker's ``model_runner.drafter.model.load_weights(iterable)`` behaves as vLLM's
  ``Eagle3LlamaForCausalLM.load_weights``: ``midlayer.`` is renamed ``layers.0.``, ``d2t``
  ``draft_id_to_target_id``, ``t2d`` skipped; each tensor is copied into an existing
  parameter of the same shape (an unknown name or another shape raises).
- ``GET /health``; ``POST /pause?mode=...``, ``POST /resume``, ``GET /is_paused``;
  ``POST /collective_rpc {"method", "args", "kwargs"}`` -> ``{"results": [per worker]}``,
  registered only with ``VLLM_SERVER_DEV_MODE=1`` (else 404); a worker's exception is an
  HTTP 500.
- Test-only: ``--fail-loads N`` makes the first N ``aerie_load_draft_weights`` calls fail
  part-way (worker 0 loads, worker 1 raises, as a worker out of memory would);
  ``GET /_contract/drafter`` -> the digest of worker 0's drafter tensors, the
  number of completed loads and of pauses, and whether the server is paused.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import torch
from safetensors.torch import load_file

SPEC_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
             "quantization", "max_model_len", "revision"}


def vllm_name(name: str) -> str | None:
    if "t2d" in name:
        return None
    return name.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id")


class Eagle3Drafter:
    """The drafter's parameters under vLLM's names, loaded the way vLLM loads them."""

    def __init__(self, directory: Path):
        self.params: dict[str, torch.Tensor] = {}
        self.load_weights(load_file(str(directory / "model.safetensors")).items(), create=True)

    def load_weights(self, weights, create: bool = False) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            target = vllm_name(name)
            if target is None:
                continue
            if create:
                self.params[target] = tensor.clone()
            elif target not in self.params:
                raise KeyError(f"no parameter {target}")
            elif self.params[target].shape != tensor.shape:
                raise ValueError(f"{target}: shape {tuple(tensor.shape)} into "
                                 f"{tuple(self.params[target].shape)}")
            else:
                self.params[target].copy_(tensor)
            loaded.add(target)
        return loaded

    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.params):
            h.update(name.encode())
            h.update(self.params[name].contiguous().numpy().tobytes())
        return h.hexdigest()


class Worker:
    def __init__(self, drafter_dir: Path):
        self.model_runner = SimpleNamespace(drafter=SimpleNamespace(
            model=Eagle3Drafter(drafter_dir)))


def worker_class(extension: str | None) -> type:
    if not extension:
        return Worker
    module, _, name = extension.rpartition(".")
    return type("Worker", (Worker, getattr(importlib.import_module(module), name)), {})


def speculative_drafter(spec_json: str) -> tuple[Path, int]:
    spec = json.loads(spec_json)
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise SystemExit(f"--speculative-config: unknown keys {sorted(unknown)}")
    method = spec.get("method")
    if method not in ("eagle3", "dflash"):
        raise SystemExit(f"--speculative-config: method {method!r} is not eagle3 or dflash")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        raise SystemExit(f"--speculative-config: num_speculative_tokens {k!r}")
    path = Path(spec["model"])
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures", [])
    if method == "eagle3" and not any(a.endswith("Eagle3") or a.startswith("Eagle3")
                                      for a in architectures):
        raise SystemExit(f"{path}: architectures {architectures} is no EAGLE-3")
    if method == "dflash":  # qwen3_dflash: the bonus token and k mask tokens per request
        if "DFlashDraftModel" not in architectures:
            raise SystemExit(f"{path}: architectures {architectures} is no DFlash drafter")
        if k > int(config["block_size"]) - 1:
            raise SystemExit(f"--speculative-config: num_speculative_tokens {k} exceeds the "
                             f"block of {config['block_size']}")
    return path, k


class Server(ThreadingHTTPServer):
    def __init__(self, port: int, workers: list, dev_mode: bool, fail_loads: int = 0):
        super().__init__(("127.0.0.1", port), Handler)
        self.workers = workers
        self.fail_loads = fail_loads
        self.dev_mode = dev_mode
        self.paused = False
        self.loads = 0
        self.pauses = 0


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/health":
            self._send(200, {})
        elif path == "/is_paused":
            self._send(200, {"is_paused": self.server.paused})
        elif path == "/_contract/drafter":
            self._send(200, {"digest": self.server.workers[0].model_runner.drafter.model.digest(),
                             "loads": self.server.loads, "paused": self.server.paused,
                             "pauses": self.server.pauses})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null") if length else None
        if url.path == "/pause":
            mode = parse_qs(url.query).get("mode", ["abort"])[0]
            if mode not in ("abort", "wait", "keep"):
                return self._send(422, {"detail": f"mode {mode}"})
            self.server.paused = True
            self.server.pauses += 1
            return self._send(200, {"status": "paused"})
        if url.path == "/resume":
            self.server.paused = False
            return self._send(200, {"status": "resumed"})
        if url.path == "/collective_rpc" and self.server.dev_mode:
            return self._rpc(body or {})
        self._send(404, {"detail": "Not Found"})

    def _rpc(self, body: dict) -> None:
        loading = body["method"] == "aerie_load_draft_weights"
        failing = loading and self.server.fail_loads > 0
        results = []
        try:
            for rank, w in enumerate(self.server.workers):
                if failing and rank == 1:
                    self.server.fail_loads -= 1
                    raise RuntimeError("CUDA out of memory (stand-in)")
                results.append(getattr(w, body["method"])(*body.get("args", []),
                                                           **body.get("kwargs", {})))
        except Exception as e:  # vLLM answers a failed RPC with a server error
            return self._send(500, {"error": f"{type(e).__name__}: {e}"})
        self.server.loads += loading
        self._send(200, {"results": results})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--speculative-config", required=True)
    p.add_argument("--worker-extension-cls", default="")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--fail-loads", type=int, default=0)
    args = p.parse_args(argv)
    drafter, _ = speculative_drafter(args.speculative_config)
    cls = worker_class(args.worker_extension_cls)
    workers = [cls(drafter) for _ in range(args.tensor_parallel_size)]
    server = Server(args.port, workers, os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
                    args.fail_loads)
    server.serve_forever()


if __name__ == "__main__":
    main()
