"""``storage_retention``: after a refresh, delete the hidden-state shards and training work
dirs of RL steps older than the refresh policy's ``retain_steps``
(:func:`pipeline.capture.retention.apply_retention`), never a step that a queued or running
``drafter_refresh`` (its window) or ``ingest_step`` (its step) reads. ``retain_steps = 0``
(the default) keeps everything and materializes with nothing deleted."""

from dagster import (
    AssetExecutionContext,
    DagsterInstance,
    DagsterRunStatus,
    MaterializeResult,
    MetadataValue,
    RunsFilter,
    asset,
)

from assets.partitions import refresh_steps, step_of
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from resources.trainer import TrainerResource

_IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
              DagsterRunStatus.STARTED]


@asset(partitions_def=refresh_steps, group_name="release", deps=["serving_drafter"],
       description="Storage retention after the refresh: shards and training work dirs of RL "
                   "steps older than the last retain_steps (refresh resource, "
                   "AERIE_RETAIN_STEPS; 0 keeps everything) are deleted, their manifests "
                   "kept and marked deleted; steps queued or running runs read are kept.")
def storage_retention(context: AssetExecutionContext, storage: StorageResource,
                      refresh: RefreshPolicyResource, trainer: TrainerResource
                      ) -> MaterializeResult:
    from pipeline.capture.retention import apply_retention, keep_from

    step = step_of(context.partition_key)
    if refresh.retain_steps == 0:
        return MaterializeResult(metadata={"retain_steps": 0, "deleted_steps": 0,
                                           "bytes_freed": 0})
    protected = in_flight_steps(context.instance, context.run.run_id, refresh.window)
    report = apply_retention(storage.build(), step, refresh.retain_steps,
                             protected=protected, work_root=trainer.work_root())
    context.log.info(f"kept steps >= {keep_from(step, refresh.retain_steps)} and "
                     f"{list(report.protected)}; deleted the shards of "
                     f"{list(report.deleted_steps)} and {len(report.work_dirs_deleted)} work "
                     f"dir(s): {report.bytes_freed} bytes")
    return MaterializeResult(metadata={
        "retain_steps": refresh.retain_steps,
        "keep_from_step": report.keep_from,
        "deleted_steps": len(report.deleted_steps),
        "deleted": MetadataValue.json(list(report.deleted_steps)),
        "protected": MetadataValue.json(list(report.protected)),
        "shard_files_deleted": report.shard_files_deleted,
        "shard_bytes_freed": report.shard_bytes_freed,
        "work_dirs_deleted": MetadataValue.json(list(report.work_dirs_deleted)),
        "work_bytes_freed": report.work_bytes_freed,
        "bytes_freed": report.bytes_freed,
    })


def in_flight_steps(instance: DagsterInstance, own_run_id: str, default_window: int
                    ) -> set[int]:
    """RL steps that other queued or running runs read: each ``drafter_refresh``'s window
    (its run config's ``vocab_mapping`` window, else ``default_window``) and each
    ``ingest_step``'s step."""
    steps: set[int] = set()
    for record in instance.get_run_records(RunsFilter(statuses=_IN_FLIGHT)):
        run = record.dagster_run
        key = run.tags.get("dagster/partition")
        if run.run_id == own_run_id or key is None:
            continue
        if run.job_name == "drafter_refresh":
            config = ((run.run_config or {}).get("ops", {}).get("vocab_mapping", {})
                      .get("config") or {})
            window = config.get("window") or default_window
            steps.update(range(max(0, step_of(key) - window + 1), step_of(key) + 1))
        elif run.job_name == "ingest_step":
            steps.add(step_of(key))
    return steps
