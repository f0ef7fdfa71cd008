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
from pipeline.release.canary import DECIDED_AT
from pipeline.serving_now import serving_history
from pipeline.storage import Storage

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class LoopEvent:
    step: int  # the refresh step of the drafter concerned (a canary's: its first RL step,
    # its verdict's: the RL step that decided it)
    kind: str  # promoted | rolled_back | canary | canary_promoted | canary_rolled_back
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
        if m.canary is not None and (before is None or before.canary is None):
            events.append(LoopEvent(m.canary.started_at, "canary",
                                    m.canary.target.registry_version))
            continue
        if before is not None and before.canary is not None:  # a canary's end
            ended = before.canary.target
            promoted = m.target is not None and m.target.fingerprint == ended.fingerprint
            decided = int(m.details.get(DECIDED_AT, before.canary.started_at))
            events.append(LoopEvent(decided, "canary_promoted" if promoted
                                    else "canary_rolled_back", ended.registry_version))
            if promoted or m.target == replaced:
                seen.add(version)
                continue
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
    _canaries(ax, observed, events)
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


def _canaries(ax, observed: Sequence[StepAcceptance], events: Sequence[LoopEvent]) -> None:
    """Each canary as a shaded span over the RL steps it drafted beside another drafter,
    ended by its verdict (green: promoted to every server, red: rolled back)."""
    ends = {e.version: e for e in events if e.kind.startswith("canary_")}
    last = max((o.step for o in observed), default=0)
    for i, e in enumerate(x for x in events if x.kind == "canary"):
        end = ends.get(e.version)
        ax.axvspan(e.step - 0.5, (end.step if end else max(last, e.step)) + 0.5,
                   color="#ff7f0e", alpha=0.12, label="canary" if i == 0 else None)
        if end is not None:
            promoted = end.kind == "canary_promoted"
            ax.annotate(f"v{e.version} {'promoted' if promoted else 'rolled back'}",
                        (end.step + 0.5, 1.0), xytext=(2, 22), textcoords="offset points",
                        color="#2ca02c" if promoted else "#d62728", fontsize=7)


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
