"""Run-history retention: once storage retention has deleted an RL step's shards, the
Dagster history of its ingestion goes too, when the refresh policy asks (``prune_history``,
``AERIE_PRUNE_HISTORY``).

For each such step (older than the window ``storage_retention`` keeps, not read by a queued
or running run, its shards committed in storage) this deletes:

- its finished runs of the data path (``ingest_step``, or an asset run selecting only data
  and monitor assets), with their event logs (``DagsterInstance.delete_run``) and their
  captured stdout/stderr (the compute log manager's ``delete_logs``); under SQLite, each
  run's own event-log file, which deleting its rows would leave at its size;
- its ``rl_steps`` partition key, so that the UI neither lists the step as missing nor
  offers to backfill it (which would extract its deleted shards again);
- (in storage, by :func:`pipeline.retention.apply_retention` with ``charts``) the loop chart
  its ``serving_acceptance`` drew, which every later step's chart supersedes; its observed
  acceptance record stays.

Refresh runs stay: they are the loop's history (what each refresh trained on, what the gate
decided, the charts), one per N steps, and the refresh sensor counts blocks from the newest.
The snapshot sensor counts a step whose shards are committed in storage as ingested, so a
step whose runs went is never requested again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from assets.groups import DATA_ASSETS, MONITOR_ASSETS
from assets.partitions import parse_step, rl_steps, step_key

log = logging.getLogger(__name__)

FINISHED = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]
_STEP_ASSETS = {*DATA_ASSETS, *MONITOR_ASSETS}


@dataclass(frozen=True)
class HistoryPruned:
    steps: tuple[int, ...]  # whose partition key went
    runs_deleted: int


def prunable_steps(instance: DagsterInstance, before: int, protected: Iterable[int],
                   extracted: Iterable[int]) -> list[int]:
    """The ``rl_steps`` partitions older than ``before``, not ``protected``, whose shards
    are committed (``extracted``: a step not extracted yet keeps its history)."""
    keep, done = set(protected), set(extracted)
    steps = (parse_step(k) for k in instance.get_dynamic_partitions(rl_steps.name))
    return sorted(s for s in steps
                  if s is not None and s < before and s not in keep and s in done)


def prune_step_history(instance: DagsterInstance, steps: Iterable[int]) -> HistoryPruned:
    """Delete the finished data-path runs of ``steps`` and their partition keys. A step
    with a run still in flight keeps everything."""
    pruned, deleted = [], 0
    for step in steps:
        key = step_key(step)
        runs = [r for r in instance.get_runs(RunsFilter(tags={"dagster/partition": key}))
                if _reads_the_step(r)]
        if any(r.status not in FINISHED for r in runs):
            continue
        for run in runs:
            _delete_run(instance, run.run_id)
            deleted += 1
        instance.delete_dynamic_partition(rl_steps.name, key)
        pruned.append(step)
    if pruned:
        log.info("run history of steps %s pruned: %d runs deleted", pruned, deleted)
    return HistoryPruned(tuple(pruned), deleted)


def _reads_the_step(run) -> bool:
    """A run of the step's data path (refresh runs share the key format, not the step)."""
    if run.job_name == "ingest_step":
        return True
    selected = {k.to_user_string() for k in (run.asset_selection or ())}
    return bool(selected) and selected <= _STEP_ASSETS


def _delete_run(instance: DagsterInstance, run_id: str) -> None:
    instance.delete_run(run_id)
    instance.compute_log_manager.delete_logs(prefix=[run_id])
    shard = getattr(instance.event_log_storage, "path_for_shard", None)  # SQLite only
    if shard is not None:
        for suffix in ("", "-wal", "-shm"):
            Path(shard(run_id) + suffix).unlink(missing_ok=True)
