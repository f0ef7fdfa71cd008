"""Canaries in release: a candidate the gate passed serves part of the rollout servers
before it serves them all.

- :func:`start_canary` acts on a gate decision, as :func:`~pipeline.release.promotion.promote`
  does (the same screening: already champion, stale or refusing decisions), but serves the
  candidate on a :class:`CanaryPlan`'s servers only
  (:meth:`~pipeline.release.backend.LedgerBackend.start_canary`); alias ``champion`` stays.
- :func:`conclude_canary` ends it on the monitor's verdict (:mod:`pipeline.monitor.canary`):
  ``promote`` makes the candidate champion on every server (its ``gate.<n>`` decision
  ``promoted``, the canary's evidence among its reasons); ``roll_back`` gives the canary's
  servers back to the champion and records the verdict as a ``refused`` decision.

Invariants:

- One canary at a time per serving name; a gate decision while one runs is refused (it
  was made against the champion alone, and the canary's steps would mix three drafters).
- Every change runs under the promotion lock, as every change of champion does; a
  conclusion names the candidate it expects and changes nothing when another canary (or
  none) serves by then (:class:`~pipeline.release.promotion.PromotionNotApplied`).
- The candidate's ``canary`` tag (JSON) follows it: started (when, where, against which
  champion), then its outcome with the evidence; decisions are the usual ``gate.<n>``
  records (``canary`` while it serves, then ``promoted`` or ``refused``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pipeline.release.backend import ServingBackend
from pipeline.release.decisions import CANARY, PROMOTED, REFUSED, DecisionRecord
from pipeline.release.gate import Decision
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import (
    NONE,
    PREVIOUS_CHAMPION,
    PromotionNotApplied,
    PromotionResult,
    held,
    make_champion,
    now,
    refuse,
    screen,
    serving_target,
)

CANARY_TAG = "canary"  # JSON: the version's canary, started and then decided
SERVING, PROMOTED_STATE, ROLLED_BACK_STATE = "serving", "promoted", "rolled_back"
CANARY_STARTED, CANARY_ROLLED_BACK = "canary", "canary_rolled_back"  # PromotionResult.action
DECIDED_AT = "canary_decided_at_step"  # serving details: the RL step whose counters decided


@dataclass(frozen=True)
class CanaryPlan:
    """Where a canary serves: a ``share`` of the rollout servers, or the named ``servers``
    (neither: no canary, the gate promotes to every server at once)."""

    share: float = 0.0
    servers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.share < 1:
            raise ValueError(f"canary_share {self.share} must be in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.share > 0 or bool(self.servers)


def start_canary(registry: DrafterRegistry, serving: ServingBackend, candidate_version: str,
                 decision: Decision, plan: CanaryPlan, *, started_at: int,
                 actor: str = "aerie", dagster_run_id: str | None = None,
                 lock: AbstractContextManager[Any] | None = None) -> PromotionResult:
    """Serve ``candidate_version`` as a canary from RL step ``started_at`` on, if
    ``decision`` promotes it (see module doc); action ``canary`` when it started."""
    candidate_version = str(candidate_version)
    with held(registry, serving, lock) as (registry, serving):
        stopped, champion = screen(registry, serving, candidate_version, decision, actor,
                                   dagster_run_id)
        if stopped is not None:
            return stopped
        current = serving.current()
        if current is not None and current.canary is not None:
            return _refused_meanwhile(registry, serving, candidate_version, decision, actor,
                                      dagster_run_id, champion, current.canary.target)
        record = DecisionRecord(CANARY, decision.reasons, actor, now(), decision.baseline,
                                decision.relative_gain, champion, dagster_run_id)
        n = registry.record_decision(candidate_version, record)
        target = serving_target(registry.get_version(candidate_version))
        where = (f"servers {', '.join(plan.servers)}" if plan.servers
                 else f"{plan.share:.0%} of the servers")
        try:
            manifest = serving.start_canary(
                target, started_at=started_at, share=plan.share, servers=plan.servers,
                reason=f"canary v{candidate_version} on {where} by the gate: "
                       f"{decision.reasons[0]}")
        except Exception as e:
            registry.set_tags(candidate_version, {f"gate.{n}.error": str(e)[:500]})
            raise PromotionNotApplied(f"{registry.model_name} v{candidate_version}: the "
                                      f"canary could not start, nothing moved: {e}") from e
        assert manifest.canary is not None
        registry.set_tags(candidate_version, {CANARY_TAG: {
            "state": SERVING, "started_at": started_at, "champion": champion or NONE,
            "servers": list(manifest.canary.servers), "share": manifest.canary.share,
            "at": now(), "decision_id": n}})
        registry.set_standing(candidate_version, n)
        return PromotionResult(CANARY_STARTED, registry.model_name, champion, champion,
                               manifest, (f"canary v{candidate_version} serves {where} from "
                                          f"RL step {started_at}", *decision.reasons))


def conclude_canary(registry: DrafterRegistry, serving: ServingBackend, candidate: str,
                    promote: bool, reason: str, evidence: Mapping[str, Any], *,
                    actor: str, lock: AbstractContextManager[Any] | None = None,
                    on_applied: Callable[[PromotionResult], None] | None = None
                    ) -> PromotionResult:
    """End the canary of ``candidate``: promote it to every server, or roll it back to the
    champion (module doc). ``on_applied(result)`` runs under the promotion lock."""
    with held(registry, serving, lock) as (registry, serving):
        current = serving.current()
        canary = current.canary if current is not None else None
        if canary is None or canary.target.registry_version != candidate:
            serving_now = f"v{canary.target.registry_version}" if canary else "none"
            raise PromotionNotApplied(f"{registry.model_name}: canary v{candidate} is no "
                                      f"longer serving (the canary now: {serving_now})")
        champion = current.target.registry_version if current.target else None
        tags = registry.get_version(candidate).tags
        started = json.loads(tags.get(CANARY_TAG, "{}"))
        outcome = {**started, "state": PROMOTED_STATE if promote else ROLLED_BACK_STATE,
                   "reason": reason, "evidence": dict(evidence), "decided_at": now()}
        decided = {DECIDED_AT: str(max(evidence.get("steps") or [canary.started_at]))}
        record = DecisionRecord(PROMOTED if promote else REFUSED, (reason,), actor, now(),
                                "champion" if champion else "no-drafter",
                                float(evidence.get("gain", float("nan"))), champion)
        if promote:
            manifest = make_champion(registry, serving, candidate,
                                     {PREVIOUS_CHAMPION: champion or NONE,
                                      CANARY_TAG: outcome},
                                     reason=f"canary v{candidate} promoted to every server: "
                                            f"{reason}", decision=record, details=decided)
            result = PromotionResult("promoted", registry.model_name, candidate, champion,
                                     manifest, (reason,))
        else:
            manifest = serving.restore(current, reason=f"canary v{candidate} rolled back: "
                                                       f"{reason}", details=decided)
            n = registry.record_decision(candidate, record)
            registry.set_tags(candidate, {CANARY_TAG: outcome})
            registry.set_standing(candidate, n)
            result = PromotionResult(CANARY_ROLLED_BACK, registry.model_name, champion,
                                     champion, manifest, (reason,))
        if on_applied is not None:
            on_applied(result)
        return result


def _refused_meanwhile(registry: DrafterRegistry, serving: ServingBackend, version: str,
                       decision: Decision, actor: str, run_id: str | None,
                       champion: str | None, running: Any) -> PromotionResult:
    served = serving_target(registry.get_version(champion)) if champion else None
    return refuse(registry, serving, version, decision, actor, run_id, served, (
        f"canary {running.name} is in progress: one canary at a time; this refresh's "
        f"drafter waits for the next refresh",))
