"""A checkpoint's final RMSNorm, for engines that hand out the last layer un-normalised.

vLLM's hidden-state export gives the last decoder layer's output before the model's final
norm (docs/vllm.md); Aerie's ``final_hidden`` is after it. :func:`load_final_norm` reads
``model.norm.weight`` and ``rms_norm_eps`` from the step's policy checkpoint in storage
without copying the checkpoint: the safetensors header, then the tensor's own byte range,
of the file the index names (``config.json`` and the index are verified against the
checkpoint's manifest; the weight's bytes are not, since that would read the whole file).
:class:`FinalNorm` applies it in float32, as ``x · rsqrt(mean(x²) + eps) · w`` (HF casts
before the weight multiply: on a bf16 model the two may differ by one bf16 ulp).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.layout import policy_prefix
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import committed, read_verified

# Families whose final norm is ``model.norm`` with weight·x (not Gemma's (1 + w)·x).
RMS_NORM_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                               "qwen3_moe", "deepseek_v2", "deepseek_v3"})
NORM_WEIGHT = "model.norm.weight"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor  # (H,) float32
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32 * scale * self.weight


def load_final_norm(storage: Storage, step: int) -> FinalNorm:
    """The final norm of ``policies/step=NNNNNN/``; a family whose norm is not weight·x,
    a missing tensor or one of the wrong shape is a ``ValueError`` naming it."""
    prefix = policy_prefix(step)
    manifest = committed(storage, prefix, POLICY_KIND)
    config = json.loads(read_verified(storage, prefix, manifest, "config.json"))
    family = config.get("model_type")
    if family not in RMS_NORM_FAMILIES:
        raise ValueError(f"{storage.url(prefix)}: model_type {family!r} is not one whose final "
                         f"norm Aerie applies ({sorted(RMS_NORM_FAMILIES)}); capture it with "
                         f"the hf or sglang backend")
    paths = {e.path for e in manifest.files}
    if "model.safetensors.index.json" in paths:
        index = json.loads(read_verified(storage, prefix, manifest,
                                         "model.safetensors.index.json"))
        name = index["weight_map"].get(NORM_WEIGHT)
    else:
        name = "model.safetensors" if "model.safetensors" in paths else None
    if name is None or name not in paths:
        raise ValueError(f"{storage.url(prefix)}: no safetensors file holds {NORM_WEIGHT}")
    weight = _read_tensor(storage, f"{prefix}/{name}", NORM_WEIGHT)
    hidden = int(config["hidden_size"])
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"{storage.url(prefix)}/{name}: {NORM_WEIGHT} has shape "
                         f"{tuple(weight.shape)}, expected ({hidden},)")
    return FinalNorm(weight, float(config.get("rms_norm_eps", 1e-6)))


def _read_tensor(storage: Storage, key: str, name: str) -> torch.Tensor:
    """One tensor of a safetensors file: its header, then only its bytes."""
    with storage.open_read(key) as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > _MAX_HEADER:
            raise ValueError(f"{storage.url(key)}: a {header_len}-byte header is not "
                             f"safetensors")
        header = json.loads(f.read(header_len))
        if name not in header:
            raise ValueError(f"{storage.url(key)}: no tensor {name}")
        info = header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{storage.url(key)}: {name} is {info['dtype']}, expected one of "
                             f"{sorted(_DTYPES)}")
        start, end = info["data_offsets"]
        f.seek(8 + header_len + start)
        data = f.read(end - start)
        if len(data) != end - start:
            raise ValueError(f"{storage.url(key)}: {name} is cut short ({len(data)} of "
                             f"{end - start} bytes)")
        raw = np.frombuffer(data, dtype=_DTYPES[info["dtype"]]).copy()
    tensor = torch.from_numpy(raw)
    if info["dtype"] == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(info["shape"]).to(torch.float32)
