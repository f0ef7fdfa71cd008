"""Refresh warm start: begin from the serving (or a given) drafter when it fits, else scratch.

A source fits when it is a drafter of the same algorithm, :func:`shapes_match` holds AND it
reads the same aux layers (``fc``'s columns mean those layers' features; equal shapes with
other ids would be a silent mismatch).
Then :func:`pipeline.eagle3.export.warm_start` copies every weight and carries ``lm_head`` rows
over by target token, so a changed draft vocab keeps what it can. The decision and its reason
are returned for the asset metadata; an unreadable source is an error, not a silent scratch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.algorithms import algorithm_of_config, algorithm_of_directory
from pipeline.eagle3.config import shapes_match
from pipeline.eagle3.export import load_drafter, read_drafter_config, warm_start
from pipeline.eagle3.model import Eagle3Drafter


def apply_warm_start(model: Eagle3Drafter, directory: str | Path | None,
                     source: str | None = None) -> dict[str, Any]:
    """Warm-start ``model`` in place from the drafter in ``directory`` if it fits.

    Returns ``{"mode": "warm" | "scratch", "source", "reason", "lm_head_rows_carried"}``.
    """
    if directory is None:
        return {"mode": "scratch", "source": None, "reason": "no warm-start drafter given",
                "lm_head_rows_carried": 0}
    directory = Path(directory)
    label = source or str(directory)
    was = algorithm_of_directory(directory)
    now = algorithm_of_config(model.config.to_sglang_config(), "the drafter in training")
    if was != now:
        return {"mode": "scratch", "source": label, "lm_head_rows_carried": 0,
                "reason": f"algorithms differ (old, new): ({was.title}, {now.title})"}
    old = read_drafter_config(directory)
    new = model.config
    if not shapes_match(new, old):
        diff = {f: (getattr(old, f), getattr(new, f))
                for f in ("hidden_size", "intermediate_size", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                          "target_hidden_size")
                if getattr(old, f) != getattr(new, f)}
        if len(old.aux_layer_ids) != len(new.aux_layer_ids):
            diff["aux layers"] = (len(old.aux_layer_ids), len(new.aux_layer_ids))
        return {"mode": "scratch", "source": label, "lm_head_rows_carried": 0,
                "reason": f"shapes differ (old, new): {diff}"}
    if tuple(old.aux_layer_ids) != tuple(new.aux_layer_ids):
        return {"mode": "scratch", "source": label, "lm_head_rows_carried": 0,
                "reason": f"aux layer ids differ: {list(old.aux_layer_ids)} vs "
                          f"{list(new.aux_layer_ids)}"}
    previous = load_drafter(directory, model.embed_tokens.weight, dtype=model.dtype)
    rows = warm_start(model, previous)
    return {"mode": "warm", "source": label, "lm_head_rows_carried": rows,
            "reason": f"shapes match; {rows}/{new.draft_vocab_size} lm_head rows carried over"}
