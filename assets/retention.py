"""``storage_retention``: after a refresh, delete the hidden-state shards and training work
dirs (and, with the refresh policy's ``prune_policies``, the policy checkpoints) of RL steps
older than the refresh policy's ``retain_steps``
(:func:`pipeline.retention.apply_retention`), never a step that a queued or running
run reads, whatever launched it: a ``drafter_refresh`` or a run of ``vocab_mapping`` /
``drafter_checkpoint`` (its window), an ``ingest_step`` or a run of ``hidden_state_shards``
(its step). With ``prune_history`` the ingestion runs and partition keys of those steps go
too (:mod:`assets.history`). This refresh's own window counts too, when its run config
widened it past ``retain_steps``. Each deleted step is recorded as an observation of its
``hidden_state_shards`` partition. ``retain_steps = 0`` (the default) keeps everything and
materializes with nothing deleted.

A run launched between the check and the deletes is not seen; the refresh job runs one at a
time (tag ``aerie/serial``), so only a run started by hand in that second can meet a deleted
step, and it fails naming the step and how to extract it again."""

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetObservation,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    MaterializeResult,
    MetadataValue,
    RunsFilter,
    asset,
)

from assets.history import prunable_steps, prune_step_history
from assets.partitions import parse_step, refresh_steps, step_key, step_of
from assets.retry import SERVICE_RETRY, fail_fast_on_permanent_errors
from assets.versions import CODE_VERSIONS
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from resources.trainer import TrainerResource

_IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
              DagsterRunStatus.STARTED]
_WINDOW_READERS = {"vocab_mapping", "drafter_checkpoint"}  # read a window's shard files
_STEP_WRITERS = {"hidden_state_shards"}


@asset(partitions_def=refresh_steps, group_name="release", deps=["registered_drafter"],
       code_version=CODE_VERSIONS["storage_retention"],
       retry_policy=SERVICE_RETRY,  # storage may be S3; a pass is idempotent
       description="Storage retention after the refresh: shards and training work dirs of RL "
                   "steps older than the last retain_steps (refresh resource, "
                   "AERIE_RETAIN_STEPS; 0 keeps everything) are deleted, with "
                   "AERIE_PRUNE_POLICIES their policy checkpoints too, their manifests "
                   "kept and marked deleted; steps queued or running runs read are kept.")
def storage_retention(context: AssetExecutionContext, storage: StorageResource,
                      refresh: RefreshPolicyResource, trainer: TrainerResource
                      ) -> MaterializeResult:
    from pipeline.retention import apply_retention, keep_from

    step = step_of(context.partition_key)
    if refresh.retain_steps == 0:
        return MaterializeResult(metadata={"retain_steps": 0, "deleted_steps": 0,
                                           "bytes_freed": 0})
    protected = in_flight_steps(context.instance, context.run.run_id, refresh.window)
    retain = max(refresh.retain_steps, window_of(context.run, refresh.window))
    with fail_fast_on_permanent_errors():
        report = apply_retention(storage.build(), step, retain, protected=protected,
                                 work_root=trainer.work_root(),
                                 policies=refresh.prune_policies,
                                 charts=refresh.prune_history)
    pruned = prune_step_history(context.instance, prunable_steps(
        context.instance, report.keep_from, protected, report.extracted)) \
        if refresh.prune_history else None
    for deleted in report.deleted_steps:
        context.log_event(AssetObservation(
            asset_key=AssetKey("hidden_state_shards"), partition=step_key(deleted),
            metadata={"deleted_by_retention": True, "by_refresh": step}))
    context.log.info(f"kept steps >= {keep_from(step, refresh.retain_steps)} and "
                     f"{list(report.protected)}; deleted the shards of "
                     f"{list(report.deleted_steps)}, {len(report.work_dirs_deleted)} work "
                     f"dir(s) and the policies of {list(report.policy_steps_deleted)}: "
                     f"{report.bytes_freed} bytes")
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
        "prune_policies": refresh.prune_policies,
        "policies_deleted": MetadataValue.json(list(report.policy_steps_deleted)),
        "policy_bytes_freed": report.policy_bytes_freed,
        "bytes_freed": report.bytes_freed,
        "prune_history": refresh.prune_history,
        "chart_files_deleted": report.chart_files_deleted,
        "history_steps_pruned": MetadataValue.json(list(pruned.steps) if pruned else []),
        "runs_deleted": pruned.runs_deleted if pruned else 0,
    })


def window_of(run: DagsterRun, default_window: int) -> int:
    """K of a refresh run: its run config's ``vocab_mapping`` window, else the default."""
    config = (run.run_config or {}).get("ops", {}).get("vocab_mapping", {}).get("config") or {}
    return int(config.get("window") or default_window)


def in_flight_steps(instance: DagsterInstance, own_run_id: str, default_window: int
                    ) -> set[int]:
    """RL steps that other queued or running runs read: the window of each run of the
    refresh's training assets (``drafter_refresh``, or an asset run selecting them) and the
    step of each run that extracts shards (``ingest_step``, or an asset run of
    ``hidden_state_shards``)."""
    steps: set[int] = set()
    for record in instance.get_run_records(RunsFilter(statuses=_IN_FLIGHT)):
        run = record.dagster_run
        key = run.tags.get("dagster/partition")
        if run.run_id == own_run_id or key is None:
            continue
        assets = {k.to_user_string() for k in (run.asset_selection or ())}
        step = parse_step(key)
        if step is None:  # a run on a key Aerie never made reads no step of its own
            continue
        if run.job_name == "drafter_refresh" or assets & _WINDOW_READERS:
            window = window_of(run, default_window)
            steps.update(range(max(0, step - window + 1), step + 1))
        if run.job_name == "ingest_step" or assets & _STEP_WRITERS:
            steps.add(step)
    return steps
