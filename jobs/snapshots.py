"""Discovering RL steps: the per-step data job and the cursor-based sensor that feeds it."""

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)

from assets.groups import DATA_ASSETS
from assets.partitions import rl_steps, step_key
from pipeline.snapshot.stage import completed_steps
from resources.storage import StorageResource

ingest_step = define_asset_job(
    "ingest_step", selection=list(DATA_ASSETS),
    description="One RL step's data path: validate the snapshot, tokenize with loss masks, "
                "capture hidden states into shards (partition = step).")


def new_steps(storage: StorageResource, cursor: str | None) -> list[int]:
    """Completed snapshot steps newer than ``cursor`` (the last step already seen)."""
    last = int(cursor) if cursor else -1
    return [s for s in completed_steps(storage.build()) if s > last]


@sensor(job=ingest_step, minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.STOPPED)
def snapshot_sensor(context: SensorEvaluationContext, storage: StorageResource):
    """Adds a partition and requests one ingest run per newly completed snapshot step.

    The cursor is the newest step seen, so a restart neither skips nor repeats steps; the
    run key is the partition key, so a step is never ingested twice by the sensor.
    """
    steps = new_steps(storage, context.cursor)
    if not steps:
        return SkipReason(f"no completed snapshot after step {context.cursor or '(none)'}")
    keys = [step_key(s) for s in steps]
    return SensorResult(
        run_requests=[RunRequest(run_key=k, partition_key=k) for k in keys],
        dynamic_partitions_requests=[rl_steps.build_add_request(keys)],
        cursor=str(steps[-1]),
    )
