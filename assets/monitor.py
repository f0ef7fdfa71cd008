"""``serving_acceptance``: acceptance as the RL engine saw it, per RL step.

Partition = the RL step (``rl_steps``), in the ``ingest_step`` job: it summarises the step's
speculative counters (τ per drafter version, :mod:`pipeline.monitor.observed`), stores them
for the drift sensor, and draws the loop's chart (τ observed over RL steps, offline τ at each
refresh, promotions and rollbacks). Where promotions are not verified on live servers (the
``manifest`` and vLLM modes) it judges the drafter serving now on those counters: below the
floor, the promotion is rolled back. A verdict, once reached, is the result of
``serving_drafter``'s check ``promotion_verified`` on the partition of the refresh that
promoted the drafter (one check, one meaning, wherever the verdict comes from); until then
that check stays not evaluated.

A canary serving part of the servers (``canary_share``) is judged here after every step
(:func:`pipeline.monitor.stage.settle_canary`): promoted to every server or rolled back once
decided, each verdict a ``serving_drafter`` event with its evidence, recorded under the
promotion lock like the rollback below.

It runs outside the pool ``promotion``, so that ingesting an RL step never waits for a
promotion: judging reads only. A rollback takes the promotion lock, as every change of
champion does (:func:`pipeline.release.promotion.rollback`; it waits for a promotion in
progress up to the registry's lock timeout, then fails and the next step judges again), and
records its ``serving_drafter`` event before releasing it. The pooled paths record theirs
after the lock is released, so a rollback that lands in that gap can be recorded before the
promotion it followed: the serving record is right, the newest event is not (a known gap,
until every path records under the lock).
"""

import functools

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.champion import (
    record_canary_verdict,
    record_champion_change,
    report_promotion_verified,
)
from assets.charts import logged_chart
from assets.loop_chart import LOOP_CHART, publish_loop_chart
from assets.partitions import rl_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from pipeline.monitor.stage import VERIFY_ACTOR
from pipeline.release.mlflow_registry import model_name
from pipeline.serving_now import read_serving
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.serving import ServingResource
from resources.storage import StorageResource


@asset(partitions_def=rl_steps, group_name="monitor",
       code_version=CODE_VERSIONS["serving_acceptance"],
       deps=["rollout_snapshot", AssetDep("serving_drafter",
                                          partition_mapping=AllPartitionMapping())],
       retry_policy=SERVICE_RETRY,
       description="τ per drafter version as the RL engine observed it in this RL step "
                   "(the rollouts' speculative counters), and the loop's chart; the verdict "
                   "on a drafter promoted without live verification (serving_drafter's "
                   "promotion_verified).")
def serving_acceptance(context: AssetExecutionContext, storage: StorageResource,
                       mlflow: MlflowResource, serving: ServingResource,
                       refresh: RefreshPolicyResource) -> MaterializeResult:
    """τ per drafter version as the RL engine observed it in this RL step."""
    from pipeline.monitor.observed import observe_step

    store, step = storage.build(), step_of(context.partition_key)
    name = model_name(mlflow.target_family)
    with fail_fast_on_permanent_errors():
        observed = observe_step(store, step, name)
        canary = _settle_canary(context, store, mlflow, serving, refresh)
        _verify_serving(context, store, mlflow, serving, refresh)
    key = publish_loop_chart(store, name, step, context.instance)
    chart = logged_chart(mlflow, lambda: _serving_run(mlflow, store, name), LOOP_CHART,
                         store.read_bytes(key), store.url(key), context.log)
    per_version = {f"tau_v{v.drafter_version}": round(v.tau, 4) for v in observed.versions
                   if v.tau is not None}
    return MaterializeResult(metadata={
        "rollouts": observed.rollouts, "with_counters": observed.with_counters,
        "impossible_counters": sum(v.impossible for v in observed.versions),
        **per_version,
        **({"canary": canary} if canary else {}),
        "versions": MetadataValue.md(_table(observed)),
        "chart": chart})


def _serving_run(mlflow: MlflowResource, store, name: str):
    """``(runs, run id)`` of the drafter serving now: the run its chart is logged to (None
    when no drafter serves)."""
    serving = read_serving(store, name)
    if serving is None or serving.target is None:
        return None, None  # no MLflow connection needed
    registry = mlflow.build()
    return registry.runs, registry.get_version(serving.target.registry_version).run_id


def _settle_canary(context, store, mlflow: MlflowResource, serving: ServingResource,
                   refresh: RefreshPolicyResource) -> str | None:
    """Judge the canary serving now, if one does, and act on its verdict: promoted to every
    server or rolled back, each a ``serving_drafter`` event recorded under the promotion
    lock; a promoted canary's ``promotion_verified`` result too. Returns the verdict's
    sentence (None: no canary serves)."""
    from dataclasses import asdict

    from pipeline.monitor import stage as monitor_stage

    @functools.cache
    def connect():
        registry = mlflow.build()
        return registry, serving.build(store, registry.model_name)

    def applied(verdict, result) -> None:  # under the promotion lock
        evidence = asdict(verdict.evidence) if verdict.evidence else {}
        record_canary_verdict(context, connect()[0], verdict.candidate, result,
                              actor=monitor_stage.CANARY_ACTOR, reason=verdict.reason,
                              evidence=evidence, store=store, refresh=refresh)

    checked = monitor_stage.settle_canary(store, model_name(mlflow.target_family), connect,
                                          serving.canary_policy(), serving.verify_policy(),
                                          on_applied=applied)
    if checked.verdict is None:
        return None
    context.log.info(f"canary: {checked.verdict.action}: {checked.verdict.reason}"
                     + (f" ({checked.note})" if checked.note else ""))
    if checked.verified is not None:
        outcome = monitor_stage.outcome_of(checked.verified)
        if outcome.established:
            report_promotion_verified(context, connect()[0], checked.verdict.candidate,
                                      outcome)
    return checked.verdict.reason


def _verify_serving(context, store, mlflow: MlflowResource, serving: ServingResource,
                    refresh: RefreshPolicyResource) -> None:
    """Judge the drafter serving now on the counters (when promotions are verified that
    way), and report a verdict reached now as its ``promotion_verified`` result."""
    from pipeline.monitor import stage as monitor_stage

    if serving.verification() != "reported":
        return  # verified on the live servers at promotion, or not at all

    @functools.cache
    def connect():  # once, and only when a drafter serves
        registry = mlflow.build()
        return registry, serving.build(store, registry.model_name)

    def rolled_back(v, r) -> None:  # under the promotion lock: no promotion comes between
        context.log.error(f"v{v.version}: {v.reason}; rolled back to "
                          f"{r.version or 'no drafter'}")
        record_champion_change(context, connect()[0], r, actor=VERIFY_ACTOR,
                               reason=f"post-promotion check: {v.reason}", store=store,
                               refresh=refresh)

    checked = monitor_stage.check_reported(store, model_name(mlflow.target_family), connect,
                                           serving.verify_policy(), on_rollback=rolled_back)
    outcome = monitor_stage.outcome_of(checked)
    if outcome.established:
        report_promotion_verified(context, connect()[0], checked.verification.version,
                                  outcome)
    else:
        context.log.info(f"promotion_verified: not evaluated: {outcome.description}")


def _table(observed) -> str:
    rows = [f"| v{v.drafter_version} | {v.rollouts} | {v.verify_ct} | "
            f"{'-' if v.tau is None else f'{v.tau:.3f}'} | "
            f"{'-' if v.tau_low is None else f'[{v.tau_low:.3f}, {v.tau_high:.3f}]'} | "
            f"{v.impossible} |" for v in observed.versions]
    if not rows:
        return f"none of the {observed.rollouts} rollouts carries speculative counters"
    return ("| drafter | rollouts | verify passes | τ | 95% interval | left out (impossible) |"
            "\n|---|---|---|---|---|---|\n" + "\n".join(rows))
