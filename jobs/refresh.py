"""Triggers of the drafter refresh: every N ingested RL steps (sensor) or on a cron (schedule).

A refresh at step s trains on the window s-K+1..s. N and K come from the ``refresh``
resource (:class:`resources.refresh.RefreshPolicyResource`; env ``AERIE_REFRESH_EVERY``,
``AERIE_REFRESH_WINDOW``); K reaches the run as typed run config. The sensor requests one
when another block of N steps has been ingested since the last refresh: refreshes land on
steps N-1, 2N-1, ... (the newest ingested step when the block completes, if ingestion
jumped ahead).
Exactly once: the run key is ``drafter-refresh-<partition>``, so a lost cursor re-requests
a key Dagster has already seen; never two at once: the sensor skips while a refresh run is
queued or running. Cursor: ``{"last": s}``, the step of the last requested refresh.
"""

import json

from dagster import (
    AssetKey,
    DagsterRunStatus,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunConfig,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from assets.drafter import VocabRunConfig
from assets.partitions import step_key, step_of
from jobs.drafter import DRAFTER_ASSETS, drafter_refresh
from jobs.snapshots import STEP_ASSETS
from resources.refresh import RefreshPolicyResource

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED]


def due_refresh(ingested: list[int], last: int, every: int) -> int | None:
    """The step to refresh at, or None: the newest ingested step once the block of ``every``
    steps after the last refresh (``last``; -1 for none) is complete."""
    if not ingested or every < 1:
        return None
    newest = max(ingested)
    return newest if (newest + 1) // every > (last + 1) // every else None


def refresh_request(step: int, window: int) -> RunRequest:
    key = step_key(step)
    return RunRequest(run_key=f"drafter-refresh-{key}", partition_key=key,
                      run_config=RunConfig(ops={"vocab_mapping": VocabRunConfig(window=window)}),
                      tags={"aerie/refresh_step": str(step)})


def ingested_steps(instance) -> list[int]:
    """Steps whose whole data path (snapshot, tokens, shards) is materialized."""
    done = set.intersection(*(instance.get_materialized_partitions(AssetKey(name))
                              for name in STEP_ASSETS))
    return sorted(step_of(k) for k in done)


def refresh_in_flight(instance) -> bool:
    return bool(instance.get_run_records(
        RunsFilter(job_name=drafter_refresh.name, statuses=IN_FLIGHT), limit=1))


@sensor(job=drafter_refresh, minimum_interval_seconds=60,
        default_status=DefaultSensorStatus.STOPPED)
def refresh_sensor(context: SensorEvaluationContext, refresh: RefreshPolicyResource):
    """Requests one drafter refresh per completed block of N ingested steps."""
    last = json.loads(context.cursor)["last"] if context.cursor else -1
    step = due_refresh(ingested_steps(context.instance), last, refresh.every)
    if step is None:
        return SkipReason(f"no new block of {refresh.every} ingested steps since step {last}")
    if refresh_in_flight(context.instance):
        return SkipReason("a drafter refresh is still queued or running")
    return SensorResult(run_requests=[refresh_request(step, refresh.window)],
                        cursor=json.dumps({"last": step}))


@schedule(job=drafter_refresh, cron_schedule="0 * * * *",
          default_status=DefaultScheduleStatus.STOPPED)
def drafter_refresh_schedule(context: ScheduleEvaluationContext,
                             refresh: RefreshPolicyResource):
    """The alternative trigger: hourly, refresh the newest ingested step if not yet done."""
    steps = ingested_steps(context.instance)
    if not steps:
        return SkipReason("no ingested RL step yet")
    refreshed = set.intersection(*(context.instance.get_materialized_partitions(AssetKey(a))
                                   for a in DRAFTER_ASSETS))
    if step_key(steps[-1]) in refreshed:
        return SkipReason(f"step {steps[-1]} is already refreshed")
    if refresh_in_flight(context.instance):
        return SkipReason("a drafter refresh is still queued or running")
    return refresh_request(steps[-1], refresh.window)
