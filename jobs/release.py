"""Jobs outside the gate: the manual promotion override and the rollback.

Both are explicit, separately named jobs that record who ran them and why (MLflow version
tags, and a ``serving_drafter`` materialization naming the new champion, the actor and the
reason, so the UI shows the champion after a rollback too); neither is a flag on the gated
``serving_drafter``. They share the promotion lock with it, and Dagster runs every promotion
path one at a time: the asset and both ops are in the pool ``promotion``, whose limit the
instance sets to 1 (``aerie/cli.py`` ``INSTANCE_YAML``).
"""

from dagster import Config, OpExecutionContext, job, op
from pydantic import Field

from assets.champion import PROMOTION_POOL, record_champion_change
from pipeline.release.promotion import PromotionResult, force_promote, rollback
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.serving import ServingResource
from resources.storage import StorageResource


class ForcePromoteConfig(Config):
    version: str = Field(description="registered model version to make champion")
    actor: str = Field(description="who decides (recorded in the version's tags)")
    reason: str = Field(description="why the gate is overridden (recorded)")


class RollbackConfig(Config):
    actor: str = Field(description="who rolls back (recorded)")
    reason: str = Field(default="rollback", description="why (recorded)")


def _record(context: OpExecutionContext, registry, r: PromotionResult, config, store,
            refresh: RefreshPolicyResource) -> dict:
    context.log.info(f"{r.model}: {r.action}; champion {r.version} (was "
                     f"{r.previous_champion}); {'; '.join(r.reasons)}")
    partition = record_champion_change(context, registry, r, actor=config.actor,
                                       reason=config.reason, store=store, refresh=refresh)
    return {"action": r.action, "champion": r.version, "previous": r.previous_champion,
            "serving_drafter_partition": partition}


@op(pool=PROMOTION_POOL)
def force_promote_op(context: OpExecutionContext, config: ForcePromoteConfig,
                     storage: StorageResource, mlflow: MlflowResource,
                     serving: ServingResource, refresh: RefreshPolicyResource) -> dict:
    """Make ``version`` champion without the gate (the override is recorded, never silent)."""
    store, registry = storage.build(), mlflow.build()
    r = force_promote(registry, serving.build(store, registry.model_name), config.version,
                      actor=config.actor, reason=config.reason, dagster_run_id=context.run_id)
    return _record(context, registry, r, config, store, refresh)


@op(pool=PROMOTION_POOL)
def rollback_op(context: OpExecutionContext, config: RollbackConfig, storage: StorageResource,
                mlflow: MlflowResource, serving: ServingResource,
                refresh: RefreshPolicyResource) -> dict:
    """Restore the previous champion (alias and serving)."""
    store, registry = storage.build(), mlflow.build()
    r = rollback(registry, serving.build(store, registry.model_name), actor=config.actor,
                 reason=config.reason, dagster_run_id=context.run_id)
    return _record(context, registry, r, config, store, refresh)


@job(description="Manual override: promote a registered drafter version without the gate, "
                 "recording who and why (MLflow tags and a serving_drafter event).")
def promote_drafter_manually():
    force_promote_op()


@job(description="Restore the previous champion drafter (registry alias and serving), "
                 "recording who and why (MLflow tags and a serving_drafter event).")
def rollback_drafter():
    rollback_op()
