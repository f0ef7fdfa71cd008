"""The ``vllm`` capture backend: hidden states that vLLM servers write as safetensors files.

Wire contract (vLLM 0.33.0, :data:`VLLM_VERSION`; sources in docs/vllm.md). Servers run
``--speculative-config`` method ``extract_hidden_states`` with the layer ids
:func:`engine_layer_ids` gives, and ``--kv-transfer-config`` connector
``ExampleHiddenStatesConnector`` with ``allow_custom_save_path``. Each sample is one
``POST /v1/completions`` (``prompt``: its token ids, ``max_tokens: 1``, top-level
``kv_transfer_params: {"hidden_states_path": P, "include_output_tokens": false}``); the
answer's top-level ``kv_transfer_params.hidden_states_path`` names ``P``, where the server
writes ``{"hidden_states": [T, layers, H] in the model dtype, "token_ids": int64 [T]}``,
possibly after answering: the reader takes a shared ``flock`` on ``P.lock``, which the
server holds exclusively until the file is written. The client deletes both files (one
still locked, of an answer it gave up on, when the backend closes).

Conventions, converted here so the shards are in Aerie's (``capture.provenance``):

- vLLM id ``k`` is the input of decoder layer ``k``: Aerie's aux layer ``l`` is vLLM's
  ``l + 1``, for every family (vLLM's DeepSeek records the same way as its Llama).
- vLLM id ``num_hidden_layers`` is the last layer's output before the final norm: the
  backend applies the checkpoint's final norm (``capture.final_norm``) for ``final_hidden``.

Invariants: one :class:`CapturedStates` per input, in order, ``T`` rows each. A missing
file, a file with the wrong rows or token ids, or an unreadable one is retried (a new
request, a new file); a file of another dtype or layer count, a server that saves
elsewhere or exports nothing, is a launch problem, raised at once
(:class:`EngineConfigError`). ``files_dir`` is where this process reads what the servers
write under ``server_files_dir`` (the same directory, or a shared mount of it).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pipeline.capture.base import CapturedStates
from pipeline.capture.engine_http import (
    EngineClient,
    EngineConfigError,
    EngineRequestError,
    TransientFailure,
    call_with_retries,
)
from pipeline.capture.final_norm import FinalNorm
from pipeline.capture.provenance import provenance

__all__ = ["VLLM_VERSION", "VLLMCaptureBackend", "VLLMCaptureConfig", "engine_layer_ids"]

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
_STATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONNECTOR_HINT = ("launch vLLM with --kv-transfer-config '{\"kv_connector\": "
                   "\"ExampleHiddenStatesConnector\", \"kv_role\": \"kv_producer\", "
                   "\"kv_connector_extra_config\": {\"shared_storage_path\": DIR, "
                   "\"allow_custom_save_path\": true}}' (docs/vllm.md)")


def engine_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` a vLLM server must be launched with: each
    aux layer's output (vLLM id ``l + 1``), then the last layer's (``num_layers``)."""
    return [int(i) + 1 for i in aux_layer_ids] + [int(num_layers)]


@dataclass(frozen=True)
class VLLMCaptureConfig:
    """Everything the backend needs; ``api_key`` (vLLM's ``--api-key``) stays out of repr."""

    urls: Sequence[str]
    files_dir: str
    hidden_size: int
    aux_layer_ids: Sequence[int]
    num_target_layers: int
    final_norm: FinalNorm = field(repr=False)
    server_files_dir: str | None = None  # files_dir as the servers see it; unset: the same
    max_concurrency: int = 8
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    file_timeout_s: float = 60.0  # for a file to appear after the answer
    cleanup_timeout_s: float = 60.0  # at close, for servers to finish files given up on
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    seed: int = 0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        given = self.urls.split(",") if isinstance(self.urls, str) else self.urls
        urls = tuple(u.strip().rstrip("/") for u in given if u.strip())
        if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"urls must be a non-empty list of http(s) URLs, got {urls}")
        object.__setattr__(self, "urls", urls)
        if not self.files_dir:
            raise ValueError("files_dir is required: where the servers' files are read")
        if self.max_concurrency < 1 or self.max_retries < 0 or self.timeout_s <= 0:
            raise ValueError("max_concurrency >= 1, max_retries >= 0 and timeout_s > 0 "
                             "required")

    @property
    def layer_ids(self) -> list[int]:
        return engine_layer_ids(self.aux_layer_ids, self.num_target_layers)

    def build(self) -> VLLMCaptureBackend:
        return VLLMCaptureBackend(self)


class VLLMCaptureBackend(EngineClient):
    """A :class:`~pipeline.capture.base.CaptureBackend` over vLLM's hidden-state files.

    Thread-safe; holds a thread pool and keep-alive sessions until :meth:`close`."""

    name = "vllm"

    def __init__(self, config: VLLMCaptureConfig) -> None:
        super().__init__(config, "vllm")
        self.hidden_size = int(config.hidden_size)
        self.aux_layer_ids: tuple[int, ...] = tuple(int(i) for i in config.aux_layer_ids)
        self._counter = itertools.count()
        self._files = Path(config.files_dir)
        self._server_files = config.server_files_dir or config.files_dir
        self._versions: set[str] | None = None
        self._unfinished: list[Path] = []  # files a server may still write: removed at close
        self._unfinished_lock = threading.Lock()

    def close(self) -> None:
        super().close()
        deadline = time.monotonic() + self.config.cleanup_timeout_s
        with self._unfinished_lock:
            unfinished, self._unfinished = self._unfinished, []
        for path in unfinished:  # a server finishes a file it was still writing
            lock = path.with_name(path.name + ".lock")
            while _held(lock) and time.monotonic() < deadline:
                time.sleep(0.01)
            if _held(lock):
                logger.warning("%s: still locked by its server %gs after close; left in place",
                               path, self.config.cleanup_timeout_s)
                continue
            path.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)

    def _remove(self, path: Path) -> None:
        """Delete a request's file and lock, or, while the server still holds the lock
        (an answer given up on), leave them for :meth:`close`."""
        lock = path.with_name(path.name + ".lock")
        if _held(lock):
            with self._unfinished_lock:
                self._unfinished.append(path)
            return
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "layer_ids": self.config.layer_ids,
                "final_norm": "checkpoint"}

    def provenance(self) -> dict[str, Any]:
        """vLLM computed the states (the version ``/version`` reported), asked for
        :func:`engine_layer_ids`; Aerie applied the final norm."""
        if self._versions is None:
            versions = set()
            for url in self.config.urls:
                try:
                    answer = self._http.get_json(url, "/version")
                except (TransientFailure, EngineRequestError) as e:
                    logger.warning("vLLM server %s: /version failed (%s)", url, e)
                    continue
                if isinstance(answer, dict) and answer.get("version"):
                    versions.add(str(answer["version"]))
            self._versions = versions
        record = provenance("vllm", ",".join(sorted(self._versions)) or "unknown",
                            self.aux_layer_ids, self.config.layer_ids[:-1])
        return {**record, "engine_final_layer_id": self.config.layer_ids[-1],
                "final_norm_applied_by": "aerie"}

    def capture(self, batch: Sequence[Sequence[int]]) -> list[CapturedStates]:
        seqs = [[int(t) for t in seq] for seq in batch]
        if any(not seq for seq in seqs):
            raise ValueError("every sample needs at least one token")
        futures = [self._pool.submit(self._one, i, seq, next(self._counter))
                   for i, seq in enumerate(seqs)]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def _one(self, sample: int, ids: list[int], request_index: int) -> CapturedStates:
        def attempt(url: str) -> CapturedStates:
            name = f"aerie-{uuid.uuid4().hex}.safetensors"
            asked = f"{self._server_files.rstrip('/')}/{name}"
            try:
                answer = self._http.post_json(url, "/v1/completions", {
                    "prompt": ids, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"hidden_states_path": asked,
                                           "include_output_tokens": False}})
                _check_saved_path(answer, asked, url)
                return self._states(self._files / name, sample, ids)
            finally:
                self._remove(self._files / name)

        return call_with_retries(attempt, urls=self.config.urls, request_index=request_index,
                                 policy=self._policy, stats=self.stats,
                                 what="vLLM hidden-state request", samples=[sample])

    def _states(self, path: Path, sample: int, ids: list[int]) -> CapturedStates:
        tensors = _read_when_written(path, sample, self.config.file_timeout_s)
        states, token_ids = tensors.get("hidden_states"), tensors.get("token_ids")
        layers, h, t = len(self.config.layer_ids), self.hidden_size, len(ids)
        if states is None or token_ids is None:
            raise TransientFailure(f"{path.name} holds {sorted(tensors)}, not hidden_states "
                                   f"and token_ids", sample=sample)
        if states.dtype not in _STATE_DTYPES:
            raise EngineConfigError(
                f"sample {sample}: {path.name} hidden_states is {states.dtype}, expected the "
                f"model dtype (bfloat16, float16 or float32): a quantising connector is not "
                f"read by this release")
        if states.dim() != 3 or tuple(states.shape[1:]) != (layers, h):
            raise EngineConfigError(
                f"sample {sample}: {path.name} hidden_states has shape {tuple(states.shape)}, "
                f"expected ({t}, {layers}, {h}): launch the server with "
                f"eagle_aux_hidden_state_layer_ids {self.config.layer_ids}")
        if states.shape[0] != t:
            raise TransientFailure(f"{path.name} hidden_states has {states.shape[0]} rows "
                                   f"for {t} tokens", sample=sample)
        if token_ids.tolist() != ids:
            raise TransientFailure(f"{path.name} token_ids differ from the prompt's {t} ids "
                                   f"(another request's file?)", sample=sample)
        if not bool(torch.isfinite(states).all()):
            raise TransientFailure(f"{path.name} holds non-finite values", sample=sample)
        aux = states[:, :-1, :].reshape(t, (layers - 1) * h)  # ascending ids: low→mid→high
        return CapturedStates(aux_hidden=aux, final_hidden=self.config.final_norm(
            states[:, -1, :]))


def _check_saved_path(answer: Any, asked: str, url: str) -> None:
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    saved = params.get("hidden_states_path") if isinstance(params, dict) else None
    if saved is None:
        raise EngineConfigError(f"vLLM server {url} answered without kv_transfer_params."
                                f"hidden_states_path: it exports no hidden states; "
                                f"{_CONNECTOR_HINT}")
    if saved != asked:
        raise EngineConfigError(f"vLLM server {url} saved to {saved!r}, not the asked "
                                f"{asked!r}: set allow_custom_save_path; {_CONNECTOR_HINT}")


def _read_when_written(path: Path, sample: int, timeout_s: float) -> dict[str, torch.Tensor]:
    """The file's tensors once the server is done with it: under a shared lock on
    ``path.lock`` when the server made one (then a missing or unreadable file is so for
    good), else as soon as the file parses."""
    deadline = time.monotonic() + timeout_s
    lock = path.with_name(path.name + ".lock")
    delay = 0.002
    while True:
        try:
            if lock.exists():
                with open(lock) as held:
                    fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return _load(path, sample)
            return load_file(str(path))
        except BlockingIOError:  # the server is still writing it
            state = "still locked by the server"
        except FileNotFoundError:
            state = "missing"
        except SafetensorError as e:
            state = f"unreadable ({e})"
        if time.monotonic() > deadline:
            raise TransientFailure(f"{path.name}: file {state} {timeout_s:g}s after the "
                                   f"answer", sample=sample)
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _load(path: Path, sample: int) -> dict[str, torch.Tensor]:
    """A file the server is done with (its lock released)."""
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise TransientFailure(f"{path.name}: missing, though the server released its lock",
                               sample=sample) from None
    except SafetensorError as e:
        raise TransientFailure(f"{path.name}: unreadable after the server released its "
                               f"lock ({e})", sample=sample) from None


def _held(lock: Path) -> bool:
    """Whether a server still holds ``lock`` exclusively (it may still write the file)."""
    try:
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except FileNotFoundError:
        return False
    return False
