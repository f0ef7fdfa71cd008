"""Changes of champion as Dagster sees them: the pool every promotion path runs in, what a
``serving_drafter`` event says, and how a change made outside that asset (manual override,
rollback, a post-promotion check's rollback, a canary's verdict) is recorded as one.

Invariant: the newest ``serving_drafter`` materialization names the drafter serving now,
whoever moved it: the gate, the override and the manual rollback run in
:data:`PROMOTION_POOL` (limit 1), and the post-promotion check's rollback in
``serving_acceptance`` (outside the pool) records its event while it holds the promotion
lock. One gap remains: the pooled paths record after releasing the lock, so that rollback
can land between a pooled change and its event (see ``assets/monitor.py``).
"""

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    MetadataValue,
    OpExecutionContext,
)

from assets.partitions import ensure_partition, ingested_steps, refresh_steps, step_key
from pipeline.checks import CheckOutcome, serving_staleness
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import PromotionResult
from pipeline.serving_now import drafter_name
from pipeline.storage import Storage
from resources.refresh import RefreshPolicyResource

PROMOTION_POOL = "promotion"  # the jobs' paths that move the champion; limit 1


def champion_metadata(p: PromotionResult, registry: DrafterRegistry, *, actor: str,
                      reason: str) -> dict:
    """What every ``serving_drafter`` event says, whoever changed (or kept) the champion;
    drafters named ``v<version> (<fingerprint>)`` (:func:`drafter_name`)."""
    champion = (p.version if p.moved else p.previous_champion) or None

    def name(version: str | None) -> str:
        return drafter_name(version, registry.get_version(version).fingerprint if version
                            else None)

    canary = p.serving.canary if p.serving is not None else None
    return {"action": p.action, "promoted": p.moved,
            "champion": name(champion), "previous_champion": name(p.previous_champion),
            "champion_version": champion or "none",
            **({"canary": canary.target.name, "canary_from_step": canary.started_at,
                "canary_servers": ", ".join(canary.servers) or f"{canary.share:.0%} of them"}
               if canary is not None else {}),
            "actor": actor, "reason": reason,
            "reasons": MetadataValue.md("\n".join(f"- {x}" for x in p.reasons)),
            "serving_sequence": p.serving.sequence if p.serving else -1}


def staleness_now(instance, store: Storage, name: str, refresh: RefreshPolicyResource
                  ) -> CheckOutcome:
    """``serving_staleness`` of the drafter serving ``name`` now, against the newest ingested
    RL step and the refresh resource's thresholds."""
    newest = (ingested_steps(instance) or [None])[-1]
    return serving_staleness(store, name, newest, stale_after_steps=refresh.stale_after_steps,
                             max_tau_drop=refresh.max_tau_drop_percent / 100)


def record_champion_change(context: OpExecutionContext, registry: DrafterRegistry,
                           p: PromotionResult, *, actor: str, reason: str, store: Storage,
                           refresh: RefreshPolicyResource, extra: dict | None = None
                           ) -> str | None:
    """Log a ``serving_drafter`` materialization for a change of champion made outside the
    asset (manual override, rollback), on the refresh partition of the new champion (of the
    one rolled back, when no drafter is left), so the UI shows who serves now and why; and
    the ``serving_staleness`` check of the new champion. Returns the partition, or None when
    nothing moved."""
    version = p.version or p.previous_champion
    if not p.moved or version is None:
        return None
    key = step_key(int(registry.get_version(version).tags["rl_step"]))
    ensure_partition(context.instance, refresh_steps, key)
    context.log_event(AssetMaterialization(
        "serving_drafter", partition=key,
        metadata=champion_metadata(p, registry, actor=actor, reason=reason) | (extra or {})))
    stale = staleness_now(context.instance, store, registry.model_name, refresh)
    context.log_event(AssetCheckEvaluation(
        asset_key=AssetKey("serving_drafter"), check_name="serving_staleness",
        passed=stale.passed, severity=AssetCheckSeverity.WARN, description=stale.description,
        metadata=stale.metadata, partition=key))
    return key


def record_canary_verdict(context: OpExecutionContext, registry: DrafterRegistry,
                          candidate: str, p: PromotionResult, *, actor: str, reason: str,
                          evidence: dict, store: Storage, refresh: RefreshPolicyResource
                          ) -> None:
    """A canary's verdict as a ``serving_drafter`` event on the candidate's refresh
    partition, with its evidence: a materialization when it was promoted (the champion
    changed), an observation when it was rolled back (the champion serves on)."""
    extra = {"canary_verdict": "promoted" if p.moved else "rolled_back",
             "canary_evidence": MetadataValue.json(evidence)}
    if p.moved:
        record_champion_change(context, registry, p, actor=actor, reason=reason, store=store,
                               refresh=refresh, extra=extra)
        return
    key = step_key(int(registry.get_version(candidate).tags["rl_step"]))
    context.log_event(AssetObservation(
        "serving_drafter", partition=key,
        metadata=champion_metadata(p, registry, actor=actor, reason=reason) | extra))


def report_promotion_verified(context: OpExecutionContext, registry: DrafterRegistry,
                              version: str, outcome: CheckOutcome) -> None:
    """A verdict reached after the promotion of ``version`` (from the RL engine's counters)
    as the result of ``serving_drafter``'s check ``promotion_verified`` on the partition of
    the refresh that promoted it."""
    key = step_key(int(registry.get_version(version).tags["rl_step"]))
    context.log_event(AssetCheckEvaluation(
        asset_key=AssetKey("serving_drafter"), check_name="promotion_verified",
        passed=bool(outcome.passed), severity=AssetCheckSeverity.ERROR,
        description=outcome.description, metadata=outcome.metadata, partition=key))
