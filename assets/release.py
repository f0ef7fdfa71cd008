"""``registered_drafter`` and ``serving_drafter``: MLflow registration and gated promotion.

Partition = the refresh step s. ``registered_drafter`` logs the training run (params,
per-step metrics, evaluation, charts, the SGLang directory) and registers a version with
lineage tags and alias ``challenger``; ``serving_drafter`` asks the gate
(:func:`pipeline.release.gate.decide`) and promotes only when it says so. The manual
override and the rollback are separate jobs (``jobs/release.py``).
"""

import json
import tempfile
from pathlib import Path

from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from assets.partitions import rl_steps, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.summary import refresh_summary
from pipeline.evaluation.charts import alpha_chart
from pipeline.records import to_json
from pipeline.release import register as register_stage
from pipeline.release import serve as serve_stage
from pipeline.release.gate import GatePolicy
from resources.mlflow import MlflowResource
from resources.serving import ServingResource
from resources.storage import StorageResource

_G = GatePolicy()


class GateConfig(Config):
    """Run config of ``serving_drafter``: the gate's policy."""

    min_relative_gain: float = Field(default=_G.min_relative_gain,
                                     description="τ must beat the champion's by this share")
    min_cycles: int = Field(default=_G.min_cycles,
                            description="draft-verify cycles a measurement needs to count")

    def to_core(self) -> GatePolicy:
        return GatePolicy(min_relative_gain=self.min_relative_gain, min_cycles=self.min_cycles)


@asset(partitions_def=rl_steps, group_name="release", kinds={"mlflow"},
       deps=["acceptance_eval"], retry_policy=SERVICE_RETRY)
def registered_drafter(context: AssetExecutionContext, storage: StorageResource,
                       mlflow: MlflowResource) -> MaterializeResult:
    """The refresh's drafter as an MLflow model version (lineage tags, alias challenger)."""
    step = step_of(context.partition_key)
    with fail_fast_on_permanent_errors(), \
            tempfile.TemporaryDirectory(prefix="aerie-register-") as tmp:
        r = register_stage.run(storage.build(), mlflow.build(), step, context.run.run_id,
                             chart_dir=Path(tmp), chart=alpha_chart)
    v = r.registration.version
    context.log.info(f"step {step}: {v.model} version {v.version}"
                     + (" (already registered)" if r.registration.reused else ""))
    return MaterializeResult(metadata={
        "model": v.model, "version": v.version, "run_id": v.run_id or "",
        "source": v.source, "reused": r.registration.reused,
        "candidate_tau": r.tau, "fingerprint": v.fingerprint or ""})


@asset(partitions_def=rl_steps, group_name="release", kinds={"sglang"},
       deps=["registered_drafter"], retry_policy=SERVICE_RETRY)
def serving_drafter(context: AssetExecutionContext, config: GateConfig,
                    storage: StorageResource, mlflow: MlflowResource,
                    serving: ServingResource) -> MaterializeResult:
    """Promote the refresh's drafter to serving iff the acceptance gate passes."""
    store, registry = storage.build(), mlflow.build()
    step = step_of(context.partition_key)
    with fail_fast_on_permanent_errors():
        r = serve_stage.run(store, registry, serving.build(store, registry.model_name), step,
                            config.to_core(), dagster_run_id=context.run.run_id)
    p = r.promotion
    context.log.info(f"step {step}: {p.action} ({'; '.join(p.reasons)})")
    return MaterializeResult(metadata={
        "action": p.action, "promoted": p.moved,
        "champion": (p.version if p.moved else p.previous_champion) or "none",
        "previous_champion": p.previous_champion or "none",
        "reasons": MetadataValue.md("\n".join(f"- {x}" for x in p.reasons)),
        "decision": MetadataValue.json(json.loads(to_json(r.decision))),
        "serving_sequence": p.serving.sequence if p.serving else -1,
        "refresh_summary": MetadataValue.md(refresh_summary(context.instance, step))})
