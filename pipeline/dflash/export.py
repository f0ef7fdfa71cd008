"""DFlash checkpoints as SGLang and vLLM load them, and the check that an export will load.

A checkpoint is a directory with ``config.json`` (:meth:`DFlashConfig.to_config_json`) and
``model.safetensors`` holding exactly :func:`~pipeline.dflash.model.exported_names` in one
float dtype: no embedding, no head, no ``d2t`` (the engines use the target's). Written
atomically (:func:`pipeline.drafters.files.write_export`).

The loader rules re-implemented by :func:`format_errors` (SGLang 0.5.23
``models/dflash.py`` and ``dflash_utils.py``, vLLM 0.33 ``qwen3_dflash.py``; SGLang silently
ignores unknown names, so an unknown name is an error here):

- ``dflash_config.target_layer_ids`` present, ids within the target's layers; no top-level
  ``eagle_aux_hidden_state_layer_ids`` (vLLM reads it first);
- ``dflash_config.mask_token_id`` below ``vocab_size`` (SGLang does not resize embeddings);
- ``fc.weight`` is ``[H, K·H]`` for K target layers (SGLang raises on a mismatch);
- exactly the per-layer names for ``num_hidden_layers`` layers, each of its shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.dflash.config import DFlashConfig, shapes_match
from pipeline.dflash.model import DFlashDrafter, exported_names
from pipeline.drafters.algorithm import scratch
from pipeline.drafters.files import CONFIG_NAME, WEIGHTS_NAME, check_dtype, write_export


def save_drafter(model: DFlashDrafter, directory: str | Path, *,
                 dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    """Write ``model`` as a checkpoint directory both engines load; returns its path."""
    name = check_dtype(dtype)
    tensors = {n: x.to("cpu", dtype).contiguous()
               for n, x in model.exported_state_dict().items()}
    return write_export(directory, tensors, model.config.to_config_json(dtype=name),
                        overwrite=overwrite)


def read_config(directory: str | Path) -> DFlashConfig:
    return DFlashConfig.from_config_json(
        json.loads((Path(directory) / CONFIG_NAME).read_text(encoding="utf-8")))


def load_drafter(directory: str | Path, target_embedding: torch.Tensor, *,
                 head: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter saved in ``directory`` on the target's embedding and ``head``, its
    ``lm_head`` weight (the embedding itself for a tied target): required, since drafting
    with another head than the target's would be lossless but wrong."""
    if head is None:
        raise ValueError(f"{directory}: a DFlash drafter drafts with the target's lm_head; "
                         f"pass head= (the embedding itself for a tied target)")
    directory = Path(directory)
    config = read_config(directory)
    expected = exported_names(config)
    with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as f:
        names = set(f.keys())
        if names != set(expected):
            raise ValueError(f"{directory / WEIGHTS_NAME}: missing "
                             f"{sorted(set(expected) - names)}, unexpected "
                             f"{sorted(names - set(expected))}")
        state = {name: f.get_tensor(name) for name in expected}
    dtype = dtype or state["fc.weight"].dtype
    embed = target_embedding.detach().to("cpu", dtype)
    model = DFlashDrafter(config, embed, head.detach().to("cpu", dtype))
    model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model.to(device)


def format_errors(directory: str | Path) -> tuple[str, ...]:
    """Every reason ``directory`` will not load as a DFlash drafter (module docstring)."""
    directory = Path(directory)
    try:
        config = read_config(directory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return (f"{CONFIG_NAME}: {e}",)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        return (f"{WEIGHTS_NAME} is missing",)
    shapes = _expected_shapes(config)
    errors = []
    try:
        with safe_open(str(weights), framework="pt") as f:
            found = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception as e:  # noqa: BLE001 - a corrupt file is a format error, not a crash
        return (f"{WEIGHTS_NAME} cannot be read: {e}",)
    for name in sorted(set(shapes) - set(found)):
        errors.append(f"{name} is missing")
    for name in sorted(set(found) - set(shapes)):
        errors.append(f"{name} is not a DFlash weight (SGLang would ignore it)")
    for name in sorted(set(shapes) & set(found)):
        if found[name] != shapes[name]:
            errors.append(f"{name} is {list(found[name])}, expected {list(shapes[name])}")
    return tuple(errors)


def _expected_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                 "mlp.down_proj.weight": (h, i)}
    shapes = {f"layers.{n}.{k}": s for n in range(config.num_hidden_layers)
              for k, s in per_layer.items()}
    shapes.update({"fc.weight": (h, config.fc_in_features), "hidden_norm.weight": (h,),
                   "norm.weight": (h,)})
    assert set(shapes) == set(exported_names(config))
    return shapes


@torch.no_grad()
def warm_start_from(model: DFlashDrafter, directory: Path, label: str) -> dict:
    """Warm-start ``model`` in place from the DFlash drafter in ``directory`` when every
    weight has its shape and it reads the same target layers; the record of what was done."""
    old, new = read_config(directory), model.config
    if not shapes_match(old, new):
        return scratch(label, f"shapes differ (old, new): {_shape_diff(old, new)}")
    if old.target_layer_ids != new.target_layer_ids:
        return scratch(label, f"target layer ids differ: {list(old.target_layer_ids)} vs "
                              f"{list(new.target_layer_ids)}")
    for name in ("mask_token_id", "rope_theta", "rope_scaling"):  # what the weights read
        if getattr(old, name) != getattr(new, name):
            return scratch(label, f"{name} differs (old, new): ({getattr(old, name)}, "
                                  f"{getattr(new, name)})")
    previous = load_drafter(directory, model.embed_tokens.weight, head=model.head,
                            dtype=model.dtype)
    model.load_state_dict(previous.state_dict(), strict=True)
    return {"mode": "warm", "source": label, "lm_head_rows_carried": 0,
            "reason": "shapes and target layers match; every weight carried over (the head "
                      "is the target's)"}


def _shape_diff(old: DFlashConfig, new: DFlashConfig) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    diff = {k: (getattr(old, k), getattr(new, k)) for k in keys
            if getattr(old, k) != getattr(new, k)}
    if len(old.target_layer_ids) != len(new.target_layer_ids):
        diff["target layers"] = (len(old.target_layer_ids), len(new.target_layer_ids))
    return diff
