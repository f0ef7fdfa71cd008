"""One picture of the loop: τ over RL steps, as the RL engine observed it with each serving
drafter, as the evaluation measured it offline at each refresh, with the promotions and
rollbacks of the serving record marked.

:func:`loop_events` reads what the chart marks from the serving ledger; :func:`loop_figure`
draws it (matplotlib's Agg backend), :func:`loop_chart` as PNG bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.layout import DRAFTERS, step_of_prefix
from pipeline.monitor.observed import StepAcceptance
from pipeline.serving_now import serving_history
from pipeline.storage import Storage

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class LoopEvent:
    step: int  # the refresh step of the drafter concerned
    kind: str  # promoted | rolled_back
    version: str


def loop_events(storage: Storage, name: str) -> list[LoopEvent]:
    """Promotions and rollbacks in the serving record of ``name``, oldest first. A manifest
    that goes back (a restore, a drafter served before, or no drafter after one) is the
    rollback of the drafter it replaced; one that serves a new drafter is its promotion."""
    history = serving_history(storage, name)
    by_sequence = {m.sequence: m for m in history}
    events, seen = [], set()
    for m in history:
        version = m.target.registry_version if m.target is not None else None
        before = by_sequence.get(m.previous_sequence)
        replaced = before.target if before is not None else None
        back = m.restored_from is not None or version in seen or (
            version is None and replaced is not None)
        if back and replaced is not None:
            events.append(LoopEvent(_step(storage, replaced), "rolled_back",
                                    replaced.registry_version))
        elif not back and m.target is not None:
            events.append(LoopEvent(_step(storage, m.target), "promoted", version))
        seen.add(version)
    return [e for e in events if e.step >= 0]


def _step(storage: Storage, target) -> int:
    step = step_of_prefix(storage.key_of(target.drafter_uri), DRAFTERS)
    return -1 if step is None else step


def loop_chart(observed: Sequence[StepAcceptance], offline: Mapping[int, float],
               events: Sequence[LoopEvent], title: str = "",
               triggers: Mapping[int, str] | None = None) -> bytes:
    """:func:`loop_figure` as PNG bytes."""
    from pipeline.evaluation.charts import _png

    return _png(loop_figure(observed, offline, events, title, triggers))


def loop_figure(observed: Sequence[StepAcceptance], offline: Mapping[int, float],
                events: Sequence[LoopEvent], title: str = "",
                triggers: Mapping[int, str] | None = None) -> Figure:
    """τ per RL step observed per drafter version (lines), the candidate's offline τ at each
    refresh (crosses, labelled with what triggered the refresh where ``triggers`` says),
    promotions (green dashes) and rollbacks (red dashes)."""
    from pipeline.evaluation.charts import _pyplot

    fig, ax = _pyplot().subplots(figsize=(7, 3.6), dpi=100)
    versions = sorted({v.drafter_version for o in observed for v in o.versions
                       if v.tau is not None}, key=_version_order)
    for version in versions:
        points = [(o.step, o.of(version).tau) for o in observed
                  if o.of(version) is not None and o.of(version).tau is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                label=f"observed, v{version}" if version != "none" else "observed, no drafter")
    if offline:
        steps = sorted(offline)
        ax.scatter(steps, [offline[s] for s in steps], marker="x", color="black", zorder=3,
                   label="offline τ at refresh")
        for s in steps:
            trigger = (triggers or {}).get(s)
            if trigger is not None:
                ax.annotate(trigger, (s, offline[s]), xytext=(4, 4), textcoords="offset points",
                            fontsize=7, color="#d62728" if trigger == "drift" else "black")
    for kind, color in (("promoted", "#2ca02c"), ("rolled_back", "#d62728")):
        for i, e in enumerate(x for x in events if x.kind == kind):
            ax.axvline(e.step, color=color, linestyle="--", linewidth=1,
                       label=kind.replace("_", " ") if i == 0 else None)
            ax.annotate(f"v{e.version}", (e.step, 1.0), xytext=(2, 2 if kind == "promoted"
                                                                else 12),
                        textcoords="offset points", color=color, fontsize=7)
    ax.set_xlabel("RL step")
    ax.set_ylabel("τ (tokens per verify pass)")
    ax.set_ylim(bottom=1.0, top=max(ax.get_ylim()[1], 1.1))  # all τ 1: still a range
    ax.set_title(title or "acceptance over RL steps")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=7)
    return fig


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
