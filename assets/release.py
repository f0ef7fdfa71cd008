"""``registered_drafter`` and ``serving_drafter``: MLflow registration and gated promotion.

Partition = the refresh step s (``refresh_steps``). ``registered_drafter`` logs the training
run (params, per-step metrics, evaluation, charts, the SGLang directory) and registers a
version with lineage tags and alias ``challenger``; ``serving_drafter`` asks the gate
(:func:`pipeline.release.gate.decide`) and promotes only when it says so; a re-run whose
candidate is the drafter serving now succeeds as ``already_champion`` and changes nothing
(serving record, alias and the champion's tags as they were).

``serving_drafter`` is materialized only when the refresh changed what serves (promoted); a
decision that leaves serving where it was (refused, already_champion, or promoted and
rolled back by the live check right after) is an observation of the partition with the
same metadata. So the
partitions view shows a refused refresh as not materialized, apart from the green ones that
changed what serves. The manual override and the rollback are separate jobs
(``jobs/release.py``); they record their change of champion as a ``serving_drafter``
materialization too (:func:`assets.champion.record_champion_change`), so the newest
``serving_drafter`` materialization always names the champion. Every promotion path runs in
the Dagster pool ``promotion`` (limit 1 on the embedded instance: ``aerie/cli.py``).
"""

import json
import math
from collections.abc import Iterator

from dagster import (
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetObservation,
    AssetSpec,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
    multi_asset,
)
from pydantic import Field

from assets.champion import PROMOTION_POOL, champion_metadata, staleness_now
from assets.charts import logged_chart
from assets.checks import established, spec
from assets.details import details_table
from assets.drafter import WINDOW_NOTE
from assets.loop_chart import LOOP_CHART, publish_loop_chart
from assets.partitions import DECISION_TAG, refresh_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.summary import refresh_summary
from assets.versions import CODE_VERSIONS
from pipeline.checks import CheckOutcome
from pipeline.release.gate import GatePolicy
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import PromotionResult
from pipeline.serving_now import drafter_name
from pipeline.storage import Storage
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.serving import ServingResource
from resources.storage import StorageResource

GATE_ACTOR = "aerie (acceptance gate)"  # the actor of the gate's serving_drafter events

_G = GatePolicy()


class GateConfig(Config):
    """Run config of ``serving_drafter``: the gate's policy."""

    min_relative_gain: float = Field(default=_G.min_relative_gain,
                                     description="τ must beat the champion's by this share")
    min_cycles: int = Field(default=_G.min_cycles,
                            description="draft-verify cycles a measurement needs to count")
    confidence: float | None = Field(
        default=_G.confidence, description="the gain's bootstrap interval over prompts, at "
                                           "this level, must lie above 0 (null: not checked)")

    def to_core(self) -> GatePolicy:
        return GatePolicy(min_relative_gain=self.min_relative_gain, min_cycles=self.min_cycles,
                          confidence=self.confidence)


@asset(partitions_def=refresh_steps, group_name="release", kinds={"mlflow"},
       code_version=CODE_VERSIONS["registered_drafter"], deps=["acceptance_eval"],
       retry_policy=SERVICE_RETRY,
       description="The refresh's drafter as an MLflow model version (lineage tags, alias "
                   "challenger). " + WINDOW_NOTE)
def registered_drafter(context: AssetExecutionContext, storage: StorageResource,
                       mlflow: MlflowResource) -> MaterializeResult:
    """The refresh's drafter as an MLflow model version (lineage tags, alias challenger)."""
    from pipeline.release import register as register_stage

    step = step_of(context.partition_key)
    registry = mlflow.build()
    with fail_fast_on_permanent_errors():  # the evaluation's charts: logged by acceptance_eval
        r = register_stage.run(storage.build(), registry, step, context.run.run_id,
                               run_tags={"dagster.run_url": mlflow.dagster_run_link(
                                   context.run.run_id)})
    v = r.registration.version
    name = drafter_name(v.version, v.fingerprint)
    context.log.info(f"step {step}: {v.model} {name}"
                     + (" (already registered)" if r.registration.reused else ""))
    links = {"mlflow_version": MetadataValue.url(mlflow.version_link(v.model, v.version))}
    if v.run_id:
        links["mlflow_run"] = MetadataValue.url(mlflow.run_link(
            registry.runs.experiment_id(), v.run_id))
    details = {"model": v.model, "run id": v.run_id, "source": v.source,
               "already registered": r.registration.reused}
    return MaterializeResult(metadata={
        "drafter": name, "version": v.version, "candidate_tau": round(r.tau, 3),
        "algorithm": v.tags.get("algorithm", "–"),
        "window_steps": MetadataValue.json(v.lineage.get("rl_step_window", [])), **links,
        "fingerprint": v.fingerprint or "",  # the drafter's identity (aerie demo, status)
        "details": MetadataValue.md(details_table(details))})


@multi_asset(
    name="serving_drafter", partitions_def=refresh_steps, retry_policy=SERVICE_RETRY,
    pool=PROMOTION_POOL, can_subset=True,  # can_subset: a pending check reports no result
    specs=[AssetSpec(
        "serving_drafter", group_name="release", deps=["registered_drafter"], skippable=True,
        code_version=CODE_VERSIONS["serving_drafter"],
        description="Promote the refresh's drafter to serving iff the acceptance gate "
                    "passes. Every change of champion is a materialization of this asset: "
                    "the gate's here, the manual override's and the rollback's from their "
                    "jobs (metadata action, champion, actor, reason); a refusal (or "
                    "a promotion rolled back at once) is an observation, so that refresh's "
                    "partition stays unmaterialized. "
                    "Runs in the pool 'promotion' (one at a time).")],
    check_specs=[spec("serving_drafter", "serving_staleness",
                      "the serving drafter is at most stale_after_steps RL steps behind the "
                      "newest ingested step, and its τ fell at most max_tau_drop_percent "
                      "since its promotion (warning)"),
                 spec("serving_drafter", "promotion_verified",
                      "the drafter this refresh promoted keeps its τ where it serves: on the "
                      "live servers right after promotion (SGLang modes with server_urls), "
                      "or in the speculative counters the RL engine reports over the next RL "
                      "steps (reported by serving_acceptance). Not evaluated while pending or "
                      "when nothing was promoted; fails when the drafter was broken (and "
                      "rolled back)")])
def serving_drafter(context: AssetExecutionContext, config: GateConfig,
                    storage: StorageResource, mlflow: MlflowResource,
                    serving: ServingResource, refresh: RefreshPolicyResource
                    ) -> Iterator[MaterializeResult]:
    """Promote the refresh's drafter to serving iff the acceptance gate passes."""
    from pipeline.records import to_json
    from pipeline.release import serve as serve_stage

    store, registry = storage.build(), mlflow.build()
    step = step_of(context.partition_key)
    with fail_fast_on_permanent_errors():
        r = serve_stage.run(store, registry, serving.build(store, registry.model_name), step,
                            config.to_core(), dagster_run_id=context.run.run_id,
                            canary=serving.canary_plan())
    p = r.promotion
    context.log.info(f"step {step}: {p.action} ({'; '.join(p.reasons)})")
    p, verified = _verify(context, store, registry, serving, step, p)
    context.instance.add_run_tags(context.run.run_id, {DECISION_TAG: p.action})
    stale = staleness_now(context.instance, store, registry.model_name, refresh)
    try:  # the picture must not fail a promotion that happened: said, not hidden
        key = publish_loop_chart(store, registry.model_name, step, context.instance)
    except Exception as e:  # noqa: BLE001
        context.log.warning(f"step {step}: the loop chart could not be drawn: "
                            f"{type(e).__name__}: {e}")
        chart = f"not drawn: {type(e).__name__}: {e}"
    else:  # on the run of the drafter this refresh decided on
        chart = logged_chart(mlflow, lambda: (registry.runs, registry.get_version(
            r.candidate).run_id), LOOP_CHART, store.read_bytes(key), store.url(key),
            context.log)
    metadata = {
        **_headline(r, p, registry),
        **champion_metadata(p, registry, actor=GATE_ACTOR, reason=f"refresh at step {step}"),
        "loop_chart": chart,
        "decision": MetadataValue.json(_rounded(json.loads(to_json(r.decision)))),
        "refresh_summary": MetadataValue.md(refresh_summary(context.instance, step))}
    checks = established(context, serving_staleness=(stale, AssetCheckSeverity.WARN),
                         promotion_verified=(verified, AssetCheckSeverity.ERROR))
    if p.action == "promoted":  # what serves changed
        yield MaterializeResult(asset_key="serving_drafter", metadata=metadata,
                                check_results=checks)
    else:  # serving is where it was (a rollback too): the decision is observed
        yield AssetObservation("serving_drafter", partition=context.partition_key,
                               metadata=metadata)
        yield from checks


def _headline(r, p: PromotionResult, registry: DrafterRegistry) -> dict:
    """What a reader needs first: the decision, the candidate against its baseline (τ
    rounded, the gain), and the reason that decided."""
    d, candidate = r.decision, r.candidate
    baseline = (f"champion v{d.champion_version}" if d.baseline == "champion"
                else "no drafter")
    gain = f"{d.relative_gain:+.1%}" if math.isfinite(d.relative_gain) else "not comparable"
    return {"action": p.action,
            "candidate": drafter_name(candidate, registry.get_version(candidate).fingerprint),
            "candidate_tau": round(d.candidate_tau, 3), "baseline": baseline,
            "baseline_tau": round(d.baseline_tau, 3), "gain": gain,
            "deciding_reason": d.reasons[0] if d.reasons else ""}


def _verify(context, store: Storage, registry: DrafterRegistry, serving: ServingResource,
            step: int, p: PromotionResult) -> tuple[PromotionResult, CheckOutcome]:
    """The post-promotion check of ``p`` (:func:`pipeline.monitor.stage.after_promotion`),
    logged: the promotion as it stands after it, and the check's outcome."""
    from pipeline.monitor import stage as monitor_stage

    after = monitor_stage.after_promotion(
        store, registry, p, step, verify=serving.verification(),
        serving=lambda: serving.build(store, registry.model_name), urls=serving.server_urls,
        policy=serving.verify_policy(), api_key=serving.api_key)
    v, now = after.verification, after.promotion
    if v is not None:
        context.log.info(f"step {step}: v{p.version} on the live servers: {v.verdict}: "
                         f"{v.reason}")
    if now.action == "rolled_back":
        context.log.error(f"step {step}: v{p.version} rolled back to "
                          f"{'v' + now.version if now.version else 'no drafter'}")
    return now, after.outcome


def _rounded(value, digits: int = 4):
    """``value`` with every float rounded (the registry's tags keep every digit)."""
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return round(value, digits) if isinstance(value, float) else value
