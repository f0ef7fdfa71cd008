"""What ``aerie status`` and the end of ``aerie demo`` print: the drafter serving now, the
refreshes and their decisions, read back from the serving record, the Dagster instance and
the acceptance reports."""

from __future__ import annotations

from dataclasses import dataclass

from dagster import DagsterInstance, RunsFilter

from aerie.demo import RefreshOutcome
from pipeline.checks import serving_staleness
from pipeline.monitor.canary import CanaryPolicy
from pipeline.serving_now import drafter_name, read_serving
from pipeline.storage import Storage


def _tau(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _steps(window: list[int]) -> str:
    return f"{window[0]}–{window[-1]}" if len(window) > 1 else str(window[0])


def refresh_table(outcomes: list[RefreshOutcome], notes: dict[str, str] | None = None
                  ) -> str:
    """Two lines per refresh: window, drafter, τ of each contestant, the decision (and the
    note for its partition, if any); then the reason that decided."""
    head = (f"{'refresh':<8} {'RL steps':<9} {'drafter':<16} {'τ':>5} {'champion τ':>10} "
            f"{'no drafter τ':>12}  decision")
    lines = [head, "-" * len(head)]
    for o in outcomes:
        step = int(o.partition.rsplit("-", 1)[1])
        lines.append(f"{step:<8} {_steps(o.window):<9} "
                     f"{drafter_name(o.version, o.fingerprint):<16} "
                     f"{o.candidate_tau:>5.2f} {_tau(o.champion_tau):>10} "
                     f"{_tau(o.no_drafter_tau):>12}  {o.action}"
                     + (f" {notes[o.partition]}" if notes and o.partition in notes else ""))
        lines.append(f"{'':<8} {_main_reason(o.reasons)}")
    return "\n".join(lines)


def _main_reason(reasons: list[str]) -> str:
    """The reason that decided: the τ comparison when there is one, else the interval (the
    gate gives it first; decisions recorded before it ordered its reasons need the search)."""
    for check in ("gain:", "confidence:"):
        found = [r for r in reasons if r.startswith(check)]
        if found:
            return found[0]
    return (reasons or [""])[0]


def staleness_lines(outcomes: list[RefreshOutcome], canaries_promoted: frozenset[str] =
                    frozenset()) -> list[str]:
    """How each champion's τ fell on the windows after its promotion (the drift that makes
    refreshes worth it): one line per champion measured on a later window. A refresh whose
    canary was promoted later (``canaries_promoted``) counts as its promotion."""
    promoted: dict[str, tuple[RefreshOutcome, list[str]]] = {}
    serving = None
    for o in outcomes:
        if serving is not None and o.champion_tau is not None \
                and o.regime == promoted[serving][0].regime:  # τ of one regime only
            promoted[serving][1].append(f"{o.champion_tau:.2f} on steps {_steps(o.window)}")
        if o.action == "promoted" or (o.action == "canary" and o.version in canaries_promoted):
            serving = o.version
            promoted[serving] = (o, [])
    return [f"v{version}: τ {first.candidate_tau:.2f} at promotion (steps "
            f"{_steps(first.window)}), then " + ", ".join(later)
            for version, (first, later) in promoted.items() if later]


@dataclass(frozen=True)
class ServingStatus:
    model: str
    drafter: str  # drafter_name(...) or "no drafter"
    since: str
    reason: str
    staleness: str
    stale: bool
    last_refresh: str
    observed: str = ""  # the serving drafter's τ as the RL engine reported it
    canary: str = ""  # a canary serving part of the servers, and where its verdict stands


def serving_status(instance: DagsterInstance, storage: Storage, model: str, *,
                   stale_after_steps: int, max_tau_drop: float, drift_window: int = 2,
                   canary_policy: CanaryPolicy | None = None) -> ServingStatus:
    """The drafter serving ``model`` now (and a canary beside it) and the newest refresh
    run."""
    from assets.partitions import ingested_steps

    record = read_serving(storage, model)
    target = record.target if record else None
    drafter = target.name if target else "no drafter"
    newest = (ingested_steps(instance) or [None])[-1]
    stale = serving_staleness(storage, model, newest, stale_after_steps=stale_after_steps,
                              max_tau_drop=max_tau_drop) if target else None
    return ServingStatus(
        model=model, drafter=drafter, since=record.written_at if record else "never",
        reason=record.reason if record else "",
        staleness=stale.description if stale else f"newest ingested RL step: {newest}",
        stale=bool(stale and not stale.passed), last_refresh=_last_refresh(instance),
        observed=_observed(storage, model, drift_window) if target else "",
        canary=_canary(storage, record, canary_policy or CanaryPolicy()) if record else "")


def _canary(storage: Storage, record, policy: CanaryPolicy) -> str:
    """A canary in progress: which drafter, where, since when, and its verdict so far."""
    from pipeline.monitor.canary import judge_canary
    from pipeline.monitor.observed import observed_series

    c = record.canary
    if c is None:
        return ""
    where = ", ".join(c.servers) if c.servers else f"{c.share:.0%} of the servers"
    champion = record.target.registry_version if record.target else "none"
    verdict = judge_canary(observed_series(storage, since=c.started_at),
                           c.target.registry_version, champion, c.started_at, policy)
    return f"{c.target.name} on {where} from RL step {c.started_at}; {verdict.reason}"


def canary_records(registry, outcomes: list[RefreshOutcome]) -> dict[str, dict]:
    """The ``canary`` tag of each refresh's drafter that started one, by version."""
    import json

    return {o.version: json.loads(registry.get_version(o.version).tags.get("canary", "{}"))
            for o in outcomes if o.action == "canary"}


def canary_lines(records: dict[str, dict]) -> list[str]:
    """What became of each canary (:func:`canary_records`): promoted or rolled back on the
    RL engine's counters, or still serving."""
    lines = []
    for version, record in records.items():
        state = record.get("state", "?")
        lines.append(f"v{version}: canary from RL step {record.get('started_at', '?')}: "
                     + (f"{state.replace('_', ' ')}: {record['reason']}" if "reason" in record
                        else "still serving part of the servers"))
    return lines


def _observed(storage: Storage, model: str, window: int) -> str:
    """The serving drafter's τ over its last ``window`` RL steps, as the RL engine reported
    it (serving_acceptance), against its τ at promotion."""
    from pipeline.monitor.drift import serving_reading

    r = serving_reading(storage, model, window)
    if r is None:
        return "its τ at promotion is unknown"
    return r.describe() if r.cycles else "no speculative counters reported with it yet"


def _last_refresh(instance: DagsterInstance) -> str:
    records = instance.get_run_records(RunsFilter(job_name="drafter_refresh"), limit=1)
    if not records:
        return "none yet"
    run = records[0].dagster_run
    partition = run.tags.get("dagster/partition", "?")
    text = f"{partition}: run {run.run_id[:8]} {run.status.value.lower()}"
    if records[0].end_time:
        from datetime import UTC, datetime

        text += f" at {datetime.fromtimestamp(records[0].end_time, UTC):%Y-%m-%d %H:%M} UTC"
    from aerie.demo import gate_outcome

    outcome = gate_outcome(instance, partition, run.run_id)
    if outcome is not None:
        text += f"; {outcome.action} {drafter_name(outcome.version, outcome.fingerprint)}"
        if outcome.reasons:
            text += f": {_main_reason(outcome.reasons)}"
    return text


def render(s: ServingStatus) -> str:
    return "\n".join([
        f"model:        {s.model}",
        f"serving now:  {s.drafter}" + (f", since {s.since}" if s.since != "never" else ""),
        *([f"why:          {s.reason}"] if s.reason else []),
        f"staleness:    {'STALE: ' if s.stale else ''}{s.staleness}",
        *([f"observed:     {s.observed}"] if s.observed else []),
        *([f"canary:       {s.canary}"] if s.canary else []),
        f"last refresh: {s.last_refresh}",
    ])
