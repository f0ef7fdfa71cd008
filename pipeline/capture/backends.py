"""Opening a capture backend for one RL step's policy checkpoint, by kind."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from pipeline.capture.base import CaptureBackend
from pipeline.capture.config import DEFAULT_TOKEN_BUDGET
from pipeline.eagle3.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from pipeline.layout import policy_prefix
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import committed, read_verified

BACKENDS = ("hf", "sglang", "vllm")


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else the CPU; a CUDA device that is not there
    is refused by name rather than left to fail inside the first forward."""
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
def open_backend(storage: Storage, step: int, kind: str = "hf", *,
                 aux_layer_ids: Sequence[int] | None = None,
                 token_budget: int = DEFAULT_TOKEN_BUDGET, hf_dtype: str = "float32",
                 hf_device: str = "cpu",
                 sglang_aux_urls: Sequence[str] = (), sglang_final_urls: Sequence[str] = (),
                 vllm_urls: Sequence[str] = (), vllm_files_dir: str | None = None,
                 vllm_server_files_dir: str | None = None,
                 client: Mapping[str, Any] | None = None) -> Iterator[CaptureBackend]:
    """The capture backend for ``step``'s policy checkpoint, closed on exit.

    ``hf`` loads ``policies/step=NNNNNN/`` in-process (``hf_dtype``: float32 | bfloat16) on
    ``hf_device`` (cpu, cuda, cuda:N, or auto: CUDA when present) and hands states out as
    bf16 on the CPU. ``sglang`` talks to servers already serving that checkpoint
    (an aux-capture server and a final-state server, see ``capture/sglang.py``); H and the
    default aux ids come from the checkpoint's ``config.json``. ``vllm`` talks to vLLM
    servers that write the states as files into ``vllm_files_dir`` (``capture/vllm.py``),
    with the checkpoint's final norm read from storage. ``client``: the engine clients'
    settings (``timeout_s``, ``connect_timeout_s``, ``max_concurrency``, ``max_retries``,
    ``api_key``; vllm also ``file_timeout_s``), their defaults where absent.
    """
    if kind == "hf":
        from pipeline.capture.hf import hf_backend_for_step

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if hf_dtype not in dtypes:
            raise ValueError(f"hf_dtype must be one of {sorted(dtypes)}, got {hf_dtype!r}")
        with hf_backend_for_step(storage, step, aux_layer_ids=aux_layer_ids,
                                 dtype=dtypes[hf_dtype], output_dtype=torch.bfloat16,
                                 token_budget=token_budget,
                                 device=resolve_device(hf_device)) as backend:
            yield backend
    elif kind in ("sglang", "vllm"):
        prefix = policy_prefix(step)
        config = json.loads(read_verified(storage, prefix, committed(storage, prefix, POLICY_KIND),
                                          "config.json"))
        layers = int(config["num_hidden_layers"])
        ids = check_aux_layer_ids(  # SGLang's DeepSeek files number layers their own way
            aux_layer_ids if aux_layer_ids is not None else default_aux_layer_ids(layers),
            layers, model_type=config.get("model_type") if kind == "sglang" else None)
        if kind == "sglang":
            from pipeline.capture.sglang import SGLangCaptureConfig

            built = SGLangCaptureConfig(
                aux_urls=tuple(sglang_aux_urls), final_urls=tuple(sglang_final_urls),
                hidden_size=int(config["hidden_size"]), aux_layer_ids=ids,
                num_target_layers=layers, request_token_budget=token_budget,
                **(client or {})).build()
        else:
            from pipeline.capture.final_norm import load_final_norm
            from pipeline.capture.vllm import VLLMCaptureConfig

            built = VLLMCaptureConfig(
                urls=tuple(vllm_urls), files_dir=vllm_files_dir or "",
                server_files_dir=vllm_server_files_dir, hidden_size=int(config["hidden_size"]),
                aux_layer_ids=ids, num_target_layers=layers,
                final_norm=load_final_norm(storage, step), **(client or {})).build()
        with built as backend:
            yield backend
    else:
        raise ValueError(f"unknown capture backend {kind!r}; expected one of {BACKENDS}")
