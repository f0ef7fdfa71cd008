"""Drafter checkpoints in the format SGLang loads, and warm starts between refreshes.

A checkpoint is a directory with ``config.json`` (:meth:`DrafterConfig.to_sglang_config`) and
``model.safetensors`` holding exactly :func:`~pipeline.eagle3.model.exported_names`: float
weights in one dtype (bf16 by default), ``d2t`` int64 and ``t2d`` bool. No ``embed_tokens``
(SGLang shares the target's embedding) unless the drafter's width differs from the target's:
then its own projected table, which the engines load instead.

Invariants:

- Atomic: both files are written into a temporary sibling directory that is renamed into
  place; a reader never sees a half-written checkpoint. An existing directory is replaced
  only with ``overwrite=True``.
- Exact names: SGLang silently ignores unknown tensor names, so saving refuses a state dict
  that drifted from SGLang's names, and loading refuses missing or unexpected tensors.
- Round trip: ``load_drafter(save_drafter(m))`` gives the same logits as ``m`` cast to the
  saved dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pipeline.drafters.files import CONFIG_NAME, WEIGHTS_NAME, check_dtype, write_export
from pipeline.eagle3.config import DrafterConfig, shapes_match
from pipeline.eagle3.model import OWN_EMBEDDING, Eagle3Drafter, exported_names


def save_drafter(model: Eagle3Drafter, config: DrafterConfig, directory: str | Path, *,
                 dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    """Write ``model`` as an SGLang-loadable checkpoint directory; returns its path."""
    if config != model.config:
        raise ValueError("config does not match the model's config")
    name = check_dtype(dtype)
    tensors = {}
    for key, x in model.exported_state_dict().items():
        x = x.to("cpu")
        tensors[key] = (x if key in ("d2t", "t2d") else x.to(dtype)).contiguous()
    return write_export(directory, tensors, config.to_sglang_config(dtype=name),
                        overwrite=overwrite)


def read_drafter_config(directory: str | Path) -> DrafterConfig:
    return DrafterConfig.from_sglang_config(
        json.loads((Path(directory) / CONFIG_NAME).read_text()))


def load_drafter(directory: str | Path, target_embedding: torch.Tensor | nn.Embedding, *,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
                 ) -> Eagle3Drafter:
    """The drafter saved in ``directory``, with the target's token embedding attached (or
    its own, when it carries one).

    ``dtype`` defaults to the dtype the weights were saved in.
    """
    directory = Path(directory)
    config = read_drafter_config(directory)
    expected = exported_names(config)
    with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as f:
        names = set(f.keys())
        missing, extra = set(expected) - names, names - set(expected)
        if missing or extra:
            raise ValueError(f"{directory / WEIGHTS_NAME}: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        state = {name: f.get_tensor(name) for name in expected}
    if dtype is None:
        dtype = state["fc.weight"].dtype
    weight = target_embedding.weight if isinstance(target_embedding, nn.Embedding) \
        else target_embedding
    if weight.shape[0] != config.vocab_size:
        raise ValueError(f"{directory}: the target's embedding has {weight.shape[0]} rows, "
                         f"the drafter's vocab_size is {config.vocab_size}")
    weight = state[OWN_EMBEDDING] if config.owns_embedding else weight.detach()
    model = Eagle3Drafter(config, weight.to("cpu", dtype))
    model.to(dtype)
    model.set_vocab(state.pop("d2t"), state.pop("t2d"))
    model.load_state_dict({**state, "d2t": model.d2t, "t2d": model.t2d}, strict=True)
    return model.to(device)


@torch.no_grad()
def warm_start(model: Eagle3Drafter, source: Eagle3Drafter) -> int:
    """Copy ``source``'s weights into ``model`` (a refresh with a possibly new vocab).

    Every weight but ``lm_head`` is copied as is. ``lm_head`` rows follow their TARGET ids:
    a row of ``model``'s draft vocab whose target token was in ``source``'s vocab takes that
    token's old row; others keep their fresh initialisation. Returns how many rows carried
    over. Raises ``ValueError`` unless :func:`shapes_match`.
    """
    if not shapes_match(model.config, source.config):
        raise ValueError("cannot warm-start: drafter shapes differ")
    src = source.state_dict()
    for name, param in model.named_parameters():
        if name != "lm_head.weight":
            param.copy_(src[name])
    new_targets = model.to_target_ids(torch.arange(model.config.draft_vocab_size,
                                                   device=model.d2t.device))
    old_t2d = source.t2d.to(new_targets.device)
    old_row_of = torch.cumsum(old_t2d.long(), 0) - 1  # target id -> old draft row
    keep = old_t2d[new_targets]  # (Vd,) new rows whose token the old head knew
    rows = old_row_of[new_targets[keep]]
    model.lm_head.weight[keep] = source.lm_head.weight.to(model.lm_head.weight)[rows]
    return int(keep.sum())
