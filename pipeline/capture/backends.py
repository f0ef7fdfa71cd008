"""The capture backends, registered once: each kind's settings and how it opens for one RL
step's policy checkpoint.

``BACKENDS`` maps a kind (``hf``, ``sglang``, ``vllm``) to its :class:`BackendKind`: the
frozen dataclass of its settings and the function that opens it. The capture resource's
choices, its typed section per kind and :func:`open_backend` all read this one dict, so a
new backend is one opener, one settings class and one entry here. Importing this module
loads neither torch nor pyarrow (the definitions import it): a backend loads what it needs
when it opens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pipeline.algorithms import algorithm
from pipeline.capture.config import DEFAULT_TOKEN_BUDGET
from pipeline.eagle3.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from pipeline.records import from_dict
from pipeline.storage import Storage

if TYPE_CHECKING:
    import torch

    from pipeline.capture.base import CaptureBackend


CaptureDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class EngineClient:
    """How the engine backends talk to their servers (the clients' defaults)."""

    timeout_s: float = 600.0  # per request
    connect_timeout_s: float = 10.0
    max_concurrency: int = 8  # requests in flight at once, over all servers
    max_retries: int = 3  # of a request that failed transiently
    api_key: str | None = field(default=None, repr=False)  # the servers' --api-key


@dataclass(frozen=True)
class HFOptions:
    """``hf``: the step's policy checkpoint loaded in this process."""

    dtype: CaptureDtype = "float32"  # the compute dtype
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto (CUDA when present)


@dataclass(frozen=True)
class SGLangOptions:
    """``sglang``: an aux-capture and a final-state server serving the step's checkpoint
    (``capture/sglang.py``)."""

    aux_urls: tuple[str, ...] = ()
    final_urls: tuple[str, ...] = ()
    client: EngineClient = EngineClient()


@dataclass(frozen=True)
class VLLMOptions:
    """``vllm``: servers that write the states as files (``capture/vllm.py``)."""

    urls: tuple[str, ...] = ()
    files_dir: str | None = None  # where this process reads the files
    server_files_dir: str | None = None  # the same directory as the servers see it
    file_timeout_s: float = 60.0  # for a file to appear after the answer
    client: EngineClient = EngineClient()


Opener = Callable[[Storage, int, Sequence[int] | None, int, Any],
                  contextlib.AbstractContextManager["CaptureBackend"]]


@dataclass(frozen=True)
class BackendKind:
    options: type  # the frozen dataclass of this kind's settings
    open: Opener  # (storage, step, aux_layer_ids, token_budget, options) -> backend


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else the CPU; a CUDA device that is not there
    is refused by name rather than left to fail inside the first forward."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ValueError(f"capture device {device!r}: torch sees {count} CUDA device(s) "
                             f"here; use 'cpu', 'auto' or an index below {count}")
    return resolved


@contextlib.contextmanager
def _open_hf(storage: Storage, step: int, aux_layer_ids: Sequence[int] | None,
             token_budget: int, options: HFOptions) -> Iterator[CaptureBackend]:
    """States computed as float32 or bfloat16 on ``options.device``, handed out as bf16 on
    the CPU."""
    import torch

    from pipeline.capture.hf import hf_backend_for_step

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if options.dtype not in dtypes:
        raise ValueError(f"hf dtype must be one of {sorted(dtypes)}, got {options.dtype!r}")
    with hf_backend_for_step(storage, step, aux_layer_ids=aux_layer_ids,
                             dtype=dtypes[options.dtype], output_dtype=torch.bfloat16,
                             token_budget=token_budget,
                             device=resolve_device(options.device)) as backend:
        yield backend


def _engine_geometry(storage: Storage, step: int, aux_layer_ids: Sequence[int] | None,
                     kind: str) -> tuple[int, int, tuple[int, ...]]:
    """``(hidden_size, layers, aux ids)`` from the step's checkpoint ``config.json``."""
    from pipeline.snapshot.policy import load_policy_config  # pyarrow: not at load time

    config = load_policy_config(storage, step)
    layers = int(config["num_hidden_layers"])
    ids = check_aux_layer_ids(  # SGLang's DeepSeek files number layers their own way
        aux_layer_ids if aux_layer_ids is not None else default_aux_layer_ids(layers),
        layers, model_type=config.get("model_type") if kind == "sglang" else None)
    return int(config["hidden_size"]), layers, tuple(ids)


@contextlib.contextmanager
def _open_sglang(storage: Storage, step: int, aux_layer_ids: Sequence[int] | None,
                 token_budget: int, options: SGLangOptions) -> Iterator[CaptureBackend]:
    from pipeline.capture.sglang import SGLangCaptureConfig

    hidden, layers, ids = _engine_geometry(storage, step, aux_layer_ids, "sglang")
    with SGLangCaptureConfig(
            aux_urls=tuple(options.aux_urls), final_urls=tuple(options.final_urls),
            hidden_size=hidden, aux_layer_ids=ids, num_target_layers=layers,
            request_token_budget=token_budget, **asdict(options.client)).build() as backend:
        yield backend


@contextlib.contextmanager
def _open_vllm(storage: Storage, step: int, aux_layer_ids: Sequence[int] | None,
               token_budget: int, options: VLLMOptions) -> Iterator[CaptureBackend]:
    """The checkpoint's final norm is read from storage (vLLM hands out pre-norm states)."""
    from pipeline.capture.final_norm import load_final_norm
    from pipeline.capture.vllm import VLLMCaptureConfig

    hidden, layers, ids = _engine_geometry(storage, step, aux_layer_ids, "vllm")
    with VLLMCaptureConfig(
            urls=tuple(options.urls), files_dir=options.files_dir or "",
            server_files_dir=options.server_files_dir, hidden_size=hidden,
            aux_layer_ids=ids, num_target_layers=layers,
            final_norm=load_final_norm(storage, step), file_timeout_s=options.file_timeout_s,
            **asdict(options.client)).build() as backend:
        yield backend


BACKENDS: dict[str, BackendKind] = {
    "hf": BackendKind(HFOptions, _open_hf),
    "sglang": BackendKind(SGLangOptions, _open_sglang),
    "vllm": BackendKind(VLLMOptions, _open_vllm),
}


def backend_options(kind: str, options: Any = None) -> Any:
    """``kind``'s settings from its dataclass, a mapping (JSON: a data-parallel extraction
    hands them to its other processes) or None (the defaults)."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown capture backend {kind!r}; expected one of "
                         f"{sorted(BACKENDS)}")
    cls = BACKENDS[kind].options
    if options is None:
        return cls()
    if isinstance(options, Mapping):
        return from_dict(cls, options)
    if not isinstance(options, cls):
        raise TypeError(f"capture backend {kind!r} takes {cls.__name__}, got "
                        f"{type(options).__name__}")
    return options


@contextlib.contextmanager
def open_backend(storage: Storage, step: int, kind: str = "hf", *,
                 aux_layer_ids: Sequence[int] | None = None,
                 token_budget: int = DEFAULT_TOKEN_BUDGET,
                 options: Any = None, layers_for: str | None = None
                 ) -> Iterator[CaptureBackend]:
    """The ``kind`` backend for ``step``'s policy checkpoint, closed on exit. ``options``:
    the kind's settings (see :func:`backend_options`). The engine backends take H and the
    default aux ids from the checkpoint's ``config.json``. ``layers_for``: a drafter
    algorithm whose default target layers are captured when ``aux_layer_ids`` is None
    (None: EAGLE-3's)."""
    settings = backend_options(kind, options)
    if aux_layer_ids is None and layers_for is not None:
        from pipeline.snapshot.policy import load_policy_config

        config = load_policy_config(storage, step)
        aux_layer_ids = algorithm(layers_for).default_layer_ids(
            int(config["num_hidden_layers"]), config.get("model_type"))
    with BACKENDS[kind].open(storage, step, aux_layer_ids, token_budget, settings) as backend:
        yield backend
