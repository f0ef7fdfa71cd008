"""PNG charts: per-position acceptance rates, τ over RL steps, the training curve.

Pure functions from numbers to PNG bytes (matplotlib's Agg backend, no display). The assets
store them next to the refresh's acceptance report (:func:`publish_chart`:
``evals/step=NNNNNN/charts/<name>.png``) and link them from their metadata, so the Dagster
event log holds a path, not the image; the registry logs them to MLflow, and the benchmarks
write them to docs/img/ (docs/benchmarks.md). matplotlib is imported on first use:
importing this module is cheap.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pipeline.layout import chart_key
from pipeline.storage import Storage

if TYPE_CHECKING:
    from matplotlib.figure import Figure


_COLORS = {"candidate": "#1f77b4", "champion": "#ff7f0e", "no_drafter": "#7f7f7f"}


def alpha_chart(alphas: Mapping[str, Sequence[float]], title: str = "") -> bytes:
    """:func:`alpha_figure` as PNG bytes."""
    return _png(alpha_figure(alphas, title))


def alpha_figure(alphas: Mapping[str, Sequence[float]], title: str = "") -> Figure:
    """Grouped bars: α_k (acceptance rate at draft position k) per contestant (a position
    never reached, NaN, as a bar of 0)."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.2), dpi=100)
    names = [n for n, a in alphas.items() if a]
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        values = [0.0 if math.isnan(a) else a for a in alphas[name]]
        xs = [k + (j - (len(names) - 1) / 2) * width for k in range(len(values))]
        ax.bar(xs, values, width, label=name, color=_COLORS.get(name))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance rate α_k")
    ax.set_ylim(0, 1)
    ax.set_title(title or "acceptance per draft position")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def tau_curve(series: Mapping[str, Mapping[int, float]], title: str = "",
              refresh_steps: Sequence[int] = ()) -> bytes:
    """Lines: τ against RL step per series (e.g. stale / refreshed / scratch drafters);
    dotted verticals at ``refresh_steps``."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.2), dpi=100)
    for name, points in series.items():
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], marker="o", markersize=3, label=name,
                color=_COLORS.get(name))
    for s in refresh_steps:
        ax.axvline(s, color="#cccccc", linestyle=":", linewidth=1)
    ax.set_xlabel("RL step")
    ax.set_ylabel("τ (tokens per cycle)")
    ax.set_ylim(bottom=1.0)
    ax.set_title(title or "acceptance length over RL steps")
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


def training_curve(history: Sequence[Mapping[str, float]], title: str = "") -> bytes:
    """Loss (left axis) and simulated acceptance length (right axis) per logged step."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.2), dpi=100)
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], color=_COLORS["candidate"], label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("TTT loss")
    right = ax.twinx()
    right.plot(steps, [h["sim_accept_length"] for h in history], color=_COLORS["champion"],
               label="simulated accept length")
    right.set_ylabel("simulated accept length")
    ax.set_title(title or "training curve")
    fig.legend(loc="upper center", fontsize=8, ncol=2, bbox_to_anchor=(0.5, 0.88))
    return _png(fig)


def publish_chart(storage: Storage, step: int, name: str, png: bytes) -> str:
    """Write ``png`` at :func:`chart_key` (atomically; a re-run overwrites it) and return its
    URL, which the assets link from their metadata."""
    key = chart_key(step, name)
    storage.write_bytes(key, png)
    return storage.url(key)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: never touch a display
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    _pyplot().close(fig)
    return buf.getvalue()
