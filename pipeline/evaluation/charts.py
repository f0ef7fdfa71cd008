"""PNG charts: per-position acceptance rates, τ over RL steps, the training curve.

Pure functions from numbers to PNG bytes (matplotlib's Agg backend, no display): assets put
them in Dagster metadata (:func:`markdown_image`), the registry logs them to MLflow, and the
benchmarks write them next to BENCHMARKS.md.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: never touch a display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend choice)

_COLORS = {"candidate": "#1f77b4", "champion": "#ff7f0e", "no_drafter": "#7f7f7f"}


def alpha_chart(alphas: Mapping[str, Sequence[float]], title: str = "") -> bytes:
    """Grouped bars: α_k (acceptance rate at draft position k) per contestant."""
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
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
    return _png(fig)


def tau_curve(series: Mapping[str, Mapping[int, float]], title: str = "",
              refresh_steps: Sequence[int] = ()) -> bytes:
    """Lines: τ against RL step per series (e.g. stale / refreshed / scratch drafters);
    dotted verticals at ``refresh_steps``."""
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
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
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
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


def markdown_image(png: bytes, alt: str) -> str:
    """Markdown that embeds ``png`` inline (Dagster renders it in the metadata panel)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def _png(fig: plt.Figure) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
