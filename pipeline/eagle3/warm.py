"""EAGLE-3's warm start: from an earlier drafter of the same algorithm when it fits.

A source fits when :func:`~pipeline.eagle3.config.shapes_match` holds AND it reads the same
aux layers (``fc``'s columns mean those layers' features; equal shapes with other ids would be
a silent mismatch). Then :func:`pipeline.eagle3.export.warm_start` copies every weight and
carries ``lm_head`` rows over by target token, so a changed draft vocab keeps what it can.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.drafters.algorithm import scratch
from pipeline.eagle3.config import shapes_match
from pipeline.eagle3.export import load_drafter, read_drafter_config, warm_start
from pipeline.eagle3.model import Eagle3Drafter

_SHAPES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size")


def warm_start_from(model: Eagle3Drafter, directory: Path, label: str) -> dict[str, Any]:
    """Warm-start ``model`` in place from the EAGLE-3 drafter in ``directory`` if it fits;
    the record of what was done and why."""
    old, new = read_drafter_config(directory), model.config
    if not shapes_match(new, old):
        diff = {f: (getattr(old, f), getattr(new, f)) for f in _SHAPES
                if getattr(old, f) != getattr(new, f)}
        if len(old.aux_layer_ids) != len(new.aux_layer_ids):
            diff["aux layers"] = (len(old.aux_layer_ids), len(new.aux_layer_ids))
        return scratch(label, f"shapes differ (old, new): {diff}")
    if tuple(old.aux_layer_ids) != tuple(new.aux_layer_ids):
        return scratch(label, f"aux layer ids differ: {list(old.aux_layer_ids)} vs "
                              f"{list(new.aux_layer_ids)}")
    previous = load_drafter(directory, model.embed_tokens.weight, dtype=model.dtype)
    rows = warm_start(model, previous)
    return {"mode": "warm", "source": label, "lm_head_rows_carried": rows,
            "reason": f"shapes match; {rows}/{new.draft_vocab_size} lm_head rows carried over"}
