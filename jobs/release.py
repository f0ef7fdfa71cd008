"""Jobs outside the gate: the manual promotion override and the rollback.

Both are explicit, separately named jobs that record who ran them and why (MLflow version
tags); neither is a flag on the gated ``serving_drafter``. They share the promotion lock
with it, and Dagster runs them one at a time (the ``promotion`` concurrency pool).
"""

from dagster import Config, OpExecutionContext, job, op
from pydantic import Field

from pipeline.release.promotion import PromotionResult, force_promote, rollback
from resources.mlflow import MlflowResource
from resources.serving import ServingResource
from resources.storage import StorageResource


class ForcePromoteConfig(Config):
    version: str = Field(description="registered model version to make champion")
    actor: str = Field(description="who decides (recorded in the version's tags)")
    reason: str = Field(description="why the gate is overridden (recorded)")


class RollbackConfig(Config):
    actor: str = Field(description="who rolls back (recorded)")
    reason: str = Field(default="rollback", description="why (recorded)")


def _log(context: OpExecutionContext, r: PromotionResult) -> dict:
    context.log.info(f"{r.model}: {r.action}; champion {r.version} (was "
                     f"{r.previous_champion}); {'; '.join(r.reasons)}")
    return {"action": r.action, "champion": r.version, "previous": r.previous_champion}


@op(pool="promotion")
def force_promote_op(context: OpExecutionContext, config: ForcePromoteConfig,
                     storage: StorageResource, mlflow: MlflowResource,
                     serving: ServingResource) -> dict:
    """Make ``version`` champion without the gate (the override is recorded, never silent)."""
    store, registry = storage.build(), mlflow.build()
    return _log(context, force_promote(registry, serving.build(store, registry.model_name),
                                       config.version, actor=config.actor,
                                       reason=config.reason, dagster_run_id=context.run_id))


@op(pool="promotion")
def rollback_op(context: OpExecutionContext, config: RollbackConfig, storage: StorageResource,
                mlflow: MlflowResource, serving: ServingResource) -> dict:
    """Restore the previous champion (alias and serving)."""
    store, registry = storage.build(), mlflow.build()
    return _log(context, rollback(registry, serving.build(store, registry.model_name),
                                  actor=config.actor, reason=config.reason,
                                  dagster_run_id=context.run_id))


@job(description="Manual override: promote a registered drafter version without the gate, "
                 "recording who and why.")
def promote_drafter_manually():
    force_promote_op()


@job(description="Restore the previous champion drafter (registry alias and serving).")
def rollback_drafter():
    rollback_op()
