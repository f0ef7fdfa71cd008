"""Refresh warm start: begin from the serving (or a given) drafter when it fits, else scratch.

A source fits only when it is a drafter of the same algorithm; then that algorithm decides
whether its shapes and layers fit and copies what it can (its record's ``warm_start``, e.g.
:func:`pipeline.eagle3.warm.warm_start_from`). The decision and its reason are returned for
the asset metadata; an unreadable source is an error, not a silent scratch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from pipeline.algorithms import algorithm_of_directory, algorithm_of_model
from pipeline.drafters.algorithm import scratch


def apply_warm_start(model: nn.Module, directory: str | Path | None,
                     source: str | None = None) -> dict[str, Any]:
    """Warm-start ``model`` in place from the drafter in ``directory`` if it fits.

    Returns ``{"mode": "warm" | "scratch", "source", "reason", "lm_head_rows_carried"}``.
    """
    if directory is None:
        return scratch(None, "no warm-start drafter given")
    directory = Path(directory)
    label = source or str(directory)
    was, now = algorithm_of_directory(directory), algorithm_of_model(model)
    if was != now:
        return scratch(label, f"algorithms differ (old, new): ({was.title}, {now.title})")
    return now.warm_start(model, directory, label)
