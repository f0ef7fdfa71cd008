"""The ``sglang`` capture backend: hidden states from running SGLang servers over HTTP.

Wire contract (SGLang 0.5.21–0.5.23, pinned to :data:`SGLANG_VERSION`; sources in
docs/sglang.md). ``POST /generate`` with ``{"input_ids": [[...], ...], "sampling_params":
{"max_new_tokens": 1, "temperature": 0}, "return_hidden_states": true}`` answers a list with
one object per input, in order (a flat ``input_ids`` gets one object). Each object's
``meta_info.hidden_states`` is a list whose entry 0 is the prefill block, one row per input
position; each later entry is the single row of one decode step (none for
``max_new_tokens: 1``). Rows are the post-final-norm last-layer states (width H) on a
final-state server, or the concatenated EAGLE-3 aux layer outputs (width ``len(ids)·H``) on
an aux-capture server. No release returns both in one request, so capture runs two passes:
``aux_urls`` serve the aux pass, ``final_urls`` the final pass.

Invariants:

- :meth:`SGLangCaptureBackend.capture` returns one :class:`CapturedStates` per input, in
  input order, ``aux_hidden`` ``[T, len(ids)·H]`` and ``final_hidden`` ``[T, H]``, row ``t``
  for input token ``t``, dtype ``config.dtype`` (float32 by default: lossless for values that
  a bf16/fp16/fp32 server serialised).
- Bodies are decoded by :func:`~pipeline.capture.sglang_decode.loads_generate` (simdjson
  into arrays: no Python float per value; same values as ``json.loads``).
- Every sample of every response is validated before it is used: ``T`` rows, the exact
  width, finite values, ``cached_tokens == 0``.
- Retry policy: transport failures, HTTP 408/429/5xx, malformed bodies, a wrong row count
  and non-finite values are retried (a flaky server can produce each once; a wrong row count
  that persists points at radix cache / chunked prefill and the final error says so).
  Missing ``hidden_states``, a wrong width, ``cached_tokens > 0`` and preflight findings are
  deterministic misconfigurations: raised at once as :class:`EngineConfigError`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from pipeline.capture.base import CapturedStates
from pipeline.capture.engine_http import (
    CallStats,
    EngineClient,
    EngineConfigError,
    EngineError,
    EngineRequestError,
    TransientFailure,
    call_with_retries,
)
from pipeline.capture.provenance import provenance
from pipeline.capture.sglang_decode import loads_generate
from pipeline.eagle3.aux_layers import check_aux_layer_ids, engine_default_ids

__all__ = ["SGLANG_VERSION", "CallStats", "SGLangCaptureBackend", "SGLangCaptureConfig",
           "EngineError", "EngineRequestError", "EngineConfigError", "plan_requests"]

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
Role = Literal["aux", "final"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SERVER_FLAGS = "--disable-radix-cache --chunked-prefill-size -1"
_AUX_FLAGS = "--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states"
_ROW_HINT = ("a server with the radix cache or chunked prefill on drops rows: launch it with "
             f"{_SERVER_FLAGS}")


@dataclass(frozen=True)
class SGLangCaptureConfig:
    """Everything the backend needs. URLs look like ``http://host:port`` (no path); a
    string is read as a comma-separated list. ``api_key`` is sent as a bearer token (SGLang's
    ``--api-key``) and kept out of ``repr``."""

    aux_urls: Sequence[str]
    final_urls: Sequence[str]
    hidden_size: int
    aux_layer_ids: Sequence[int]
    num_target_layers: int | None = None  # lets preflight check a server's default aux ids
    max_concurrency: int = 8
    request_batch_size: int = 8
    request_token_budget: int = 16384  # tokens per request: JSON bodies grow with T·width
    # floats per batched request (T · aux width, ~12 bytes of JSON each; a longer sample goes
    # alone): decoding slows as bodies grow (bench/sglang_decode.py: 12.1x json.loads at
    # 2.1M floats, 10.2x at 6.3M, 8.6x at 12.6M)
    request_float_budget: int = 1 << 21
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    seed: int = 0
    dtype: str = "float32"
    preflight: bool = True
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("aux_urls", "final_urls"):
            given = getattr(self, name)
            if isinstance(given, str):
                given = given.split(",")
            urls = tuple(u.strip().rstrip("/") for u in given if u.strip())
            if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
                raise ValueError(f"{name} must be a non-empty list of http(s) URLs, got {urls}")
            object.__setattr__(self, name, urls)
        object.__setattr__(self, "aux_layer_ids", check_aux_layer_ids(
            self.aux_layer_ids, self.num_target_layers))
        if self.hidden_size <= 0:
            raise ValueError("hidden_size must be positive")
        if min(self.max_concurrency, self.request_batch_size, self.request_token_budget,
               self.request_float_budget) < 1:
            raise ValueError("max_concurrency, request_batch_size, request_token_budget and "
                             "request_float_budget must be >= 1")
        if self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("max_retries >= 0, timeout_s > 0 and backoff_s >= 0 required")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    def build(self) -> SGLangCaptureBackend:
        return SGLangCaptureBackend(self)


def plan_requests(lengths: Sequence[int], max_samples: int, token_budget: int) -> list[list[int]]:
    """Split sample indices into contiguous requests of at most ``max_samples`` samples and
    ``token_budget`` tokens (a single longer sample gets a request of its own)."""
    plan: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if current and (len(current) == max_samples or tokens + n > token_budget):
            plan.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        plan.append(current)
    return plan


def parse_generate_response(body: Any, *, url: str, samples: Sequence[int],
                            lengths: Sequence[int], width: int, role: Role,
                            hidden_size: int) -> list[torch.Tensor]:
    """Validate one ``/generate`` answer and return each sample's ``[T, width]`` float32 rows."""
    outputs = [body] if isinstance(body, dict) and len(samples) == 1 else body
    if not isinstance(outputs, list) or len(outputs) != len(samples):
        raise TransientFailure(f"malformed response: expected a list of {len(samples)} "
                               f"outputs, got {type(body).__name__}")
    return [_sample_rows(out, url=url, sample=s, length=n, width=width, role=role,
                         hidden_size=hidden_size)
            for out, s, n in zip(outputs, samples, lengths, strict=True)]


def _sample_rows(out: Any, *, url: str, sample: int, length: int, width: int, role: Role,
                 hidden_size: int) -> torch.Tensor:
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        raise TransientFailure("malformed response: an output without meta_info", sample=sample)
    if meta.get("hidden_states") is None:
        raise EngineConfigError(
            f"server at {url} returned no meta_info.hidden_states for sample {sample}: it was "
            "not started with --enable-return-hidden-states (or --return-hidden-states-mode "
            "full)")
    if meta.get("cached_tokens"):
        raise EngineConfigError(
            f"server at {url} reused {meta['cached_tokens']} cached prefix tokens for sample "
            f"{sample}, so its rows are misaligned: launch it with {_SERVER_FLAGS}")
    blocks = meta["hidden_states"]
    block = blocks[0] if isinstance(blocks, list) and blocks else None
    if not isinstance(block, list | np.ndarray):
        raise TransientFailure("malformed response: hidden_states[0] is not a list of rows",
                               sample=sample)
    if len(block) != length:
        raise TransientFailure(f"{len(block)} rows for {length} input tokens ({_ROW_HINT})",
                               sample=sample)
    try:
        rows = (torch.from_numpy(block.astype(np.float32)) if isinstance(block, np.ndarray)
                else torch.tensor(block, dtype=torch.float32))
    except TypeError:  # orjson writes NaN/inf as null
        bad = next(t for t, r in enumerate(block) if not isinstance(r, list) or None in r)
        raise TransientFailure(f"non-finite or null value in row {bad}", sample=sample) from None
    except ValueError:  # ragged rows
        widths = sorted({len(r) if isinstance(r, list) else -1 for r in block})
        if len(widths) > 1:
            raise TransientFailure(f"ragged rows (widths {widths})", sample=sample) from None
        raise TransientFailure("malformed rows", sample=sample) from None
    if rows.ndim != 2:
        raise TransientFailure(f"rows have shape {tuple(rows.shape)}", sample=sample)
    if rows.shape[1] != width:
        raise EngineConfigError(_width_message(url, sample, rows.shape[1], width, role,
                                                     hidden_size))
    finite = np.isfinite(rows.numpy())  # numpy: ~10x faster than torch.isfinite here
    if not finite.all():
        bad = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise TransientFailure(f"non-finite value in row {bad}", sample=sample)
    return rows


def _width_message(url: str, sample: int, got: int, want: int, role: Role, h: int) -> str:
    head = f"server at {url} returned rows of width {got} for sample {sample}, expected {want}"
    if role == "final" and got > h and got % h == 0:
        return (f"{head} (final states, H={h}): it looks like an aux-capture server "
                f"({_AUX_FLAGS}); list it under aux_urls and a server without those flags "
                "under final_urls")
    if role == "aux" and got == h:
        return (f"{head} (aux states): it returns final states; an aux-capture server needs "
                f"{_AUX_FLAGS} [--return-aux-hidden-state-layer-ids ...]")
    return f"{head}: check hidden_size and the number of aux layer ids against the served model"


def check_server_info(info: dict[str, Any], role: Role, config: SGLangCaptureConfig) -> list[str]:
    """Launch-flag problems visible in ``/server_info`` (keys absent there are not judged)."""
    problems = []
    mode = info.get("return_hidden_states_mode")
    if info.get("enable_return_hidden_states") is False and mode != "full":
        problems.append("--enable-return-hidden-states (or --return-hidden-states-mode full) "
                        "is off")
    elif mode not in (None, "full"):
        problems.append(f"--return-hidden-states-mode is {mode!r}; capture needs 'full'")
    if info.get("disable_radix_cache") is False:
        problems.append("the radix cache is on (cached prefixes drop rows): add "
                        "--disable-radix-cache")
    chunk = info.get("chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0:
        problems.append(f"chunked prefill is on (size {chunk}; non-final chunks drop rows): "
                        "add --chunked-prefill-size -1")
    aux_on = info.get("enable_return_aux_hidden_states")
    if role == "final" and aux_on:
        problems.append(f"aux capture is on ({_AUX_FLAGS}) but the server is in final_urls")
    if role == "aux":
        if info.get("speculative_algorithm", "EAGLE3") != "EAGLE3" or aux_on is False:
            problems.append(f"aux capture is off: launch it with {_AUX_FLAGS}")
        ids = info.get("return_aux_hidden_state_layer_ids")
        if ids is None and config.num_target_layers is not None:
            ids = engine_default_ids(config.num_target_layers)  # what it captures unasked
        if ids is not None and tuple(ids) != tuple(config.aux_layer_ids):
            problems.append(f"it captures aux layers {list(ids)}, capture wants "
                            f"{list(config.aux_layer_ids)}: pass "
                            "--return-aux-hidden-state-layer-ids")
    return problems


class SGLangCaptureBackend(EngineClient):
    """A :class:`~pipeline.capture.base.CaptureBackend` over SGLang ``/generate``.

    Thread-safe; holds a thread pool and keep-alive sessions until :meth:`close` (also a
    context manager). ``stats`` counts attempts, retries and failures per URL.
    """

    def __init__(self, config: SGLangCaptureConfig) -> None:
        super().__init__(config, "sglang")
        self.hidden_size = config.hidden_size
        self.aux_layer_ids: tuple[int, ...] = tuple(config.aux_layer_ids)
        self._counters = {"aux": itertools.count(), "final": itertools.count()}
        self._checked: set[tuple[Role, str]] = set()
        self._versions: set[str] = set()  # what /server_info reported
        self._engine_ids: tuple[int, ...] | None = None  # the aux servers' own layer ids
        self._lock = threading.Lock()

    @property
    def request_tokens(self) -> int:
        """Tokens per request: the token budget, or fewer when the aux rows would exceed the
        float budget (a single longer sample still goes alone)."""
        return max(1, min(self.config.request_token_budget,
                          self.config.request_float_budget // self._width("aux")))

    def _width(self, role: Role) -> int:
        return self.hidden_size * (len(self.aux_layer_ids) if role == "aux" else 1)

    def check_servers(self) -> None:
        """Preflight every URL once: read ``/server_info`` (or the older ``/get_server_info``)
        and raise :class:`EngineConfigError` on a launch-flag problem. A server that
        exposes neither, or cannot be reached now, is only logged: per-response validation
        still guards it."""
        with self._lock:
            for role, urls in (("aux", self.config.aux_urls), ("final", self.config.final_urls)):
                for url in urls:
                    if (role, url) not in self._checked:
                        self._check_one(url, role)
                        self._checked.add((role, url))

    def _check_one(self, url: str, role: Role) -> None:
        try:
            info = (self._http.get_json(url, "/server_info")
                    or self._http.get_json(url, "/get_server_info"))
        except (TransientFailure, EngineRequestError) as e:
            logger.warning("preflight of %s server %s failed (%s); relying on response checks",
                           role, url, e)
            return
        if not isinstance(info, dict):
            logger.warning("%s server %s exposes no server info; relying on response checks",
                           role, url)
            return
        problems = check_server_info(info, role, self.config)
        if problems:
            raise EngineConfigError(
                f"{role} server at {url} is misconfigured: " + "; ".join(problems)
                + " (launch commands: docs/sglang.md)")
        if info.get("version") is not None:
            self._versions.add(str(info["version"]))
        if role == "aux" and info.get("return_aux_hidden_state_layer_ids") is not None:
            self._engine_ids = tuple(int(i) for i in info["return_aux_hidden_state_layer_ids"])
        if info.get("version") not in (None, SGLANG_VERSION):
            logger.warning("%s server %s runs SGLang %s; Aerie targets %s", role, url,
                           info.get("version"), SGLANG_VERSION)

    def provenance(self) -> dict[str, Any]:
        """SGLang computed the states: the version(s) its servers reported in preflight
        (``unknown`` when none did) and the aux ids they were launched with, in SGLang's
        numbering (its models capture ``id + 1`` on entry: Aerie's ids)."""
        if self.config.preflight:
            self.check_servers()
        with self._lock:
            version = ",".join(sorted(self._versions)) or "unknown"
            engine_ids = self._engine_ids
        return provenance("sglang", version, self.aux_layer_ids, engine_ids)

    def capture(self, batch: Sequence[Sequence[int]]) -> list[CapturedStates]:
        seqs = [[int(t) for t in seq] for seq in batch]
        if any(not seq for seq in seqs):
            raise ValueError("every sample needs at least one token")
        if not seqs:
            return []
        if self.config.preflight:
            self.check_servers()
        lengths = [len(s) for s in seqs]
        plan = plan_requests(lengths, self.config.request_batch_size,
                             self.request_tokens)
        roles: tuple[Role, ...] = ("aux", "final")
        # Request indices are drawn here, in submission order, so the round-robin is
        # deterministic whatever the thread timing.
        jobs = [(role, chunk, self._pool.submit(self._run, role, chunk, seqs,
                                                next(self._counters[role])))
                for chunk in plan for role in roles]
        done, pending = wait([f for *_, f in jobs], return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for *_, f in jobs:  # raise the first failure in submission order
            error = f.exception() if f in done else None
            if error is not None:
                raise error
        rows: dict[Role, dict[int, torch.Tensor]] = {"aux": {}, "final": {}}
        for role, chunk, f in jobs:
            rows[role].update(zip(chunk, f.result(), strict=True))
        dtype = _DTYPES[self.config.dtype]
        return [CapturedStates(aux_hidden=rows["aux"][i].to(dtype),
                               final_hidden=rows["final"][i].to(dtype))
                for i in range(len(seqs))]

    def _run(self, role: Role, samples: list[int], seqs: list[list[int]],
             request_index: int) -> list[torch.Tensor]:
        urls = self.config.aux_urls if role == "aux" else self.config.final_urls
        payload = {"input_ids": [seqs[i] for i in samples],
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                   "return_hidden_states": True}
        lengths = [len(seqs[i]) for i in samples]

        def attempt(url: str) -> list[torch.Tensor]:
            body = self._http.post_json(url, "/generate", payload, loads=loads_generate)
            return parse_generate_response(body, url=url, samples=samples, lengths=lengths,
                                           width=self._width(role), role=role,
                                           hidden_size=self.hidden_size)

        return call_with_retries(attempt, urls=urls, request_index=request_index,
                                 policy=self._policy, stats=self.stats,
                                 what=f"SGLang {role} pass", samples=samples)
