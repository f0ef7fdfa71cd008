"""Discovering RL steps: the per-step data job and the sensor that feeds it.

The sensor requests every completed snapshot step that is not ingested yet, in any order:
a step whose snapshot completes after a later one (trainers that write asynchronously) is
requested when it completes. "Not ingested" means neither of:

- an ``ingest_step`` run of the step's partition that has not failed (queued, running or
  succeeded): it will ingest the step, or did;
- all three data assets materialized in the partition (ingested another way: a UI backfill,
  a manual run);
- its shards committed in storage (``shards/step=NNNNNN/_manifest.json``, also once retention
  deleted the shards): ingested under another Dagster instance, or a step whose run history
  retention pruned (:mod:`assets.history`). A rewrite withdraws that manifest first.

A failed or canceled ingest stays pending: the step is requested again on later ticks. The
daemon never launches a run key twice, so that starts no second run (the tick lists it as
skipped, the failure stays visible until someone re-runs the partition); ``aerie demo``,
which executes the requests itself, retries it.

Only step directories as the layout writes them count (``step=NNNNNN``,
:func:`pipeline.layout.parse_step_dir`): anything else under ``rollouts/`` (``step=0003``,
``step=²``, a stray file) is skipped with a warning naming a few of them, never requested and
never a reason to fail the tick.

A step the trainer **rewrites** after it was requested (a trainer restarted from a
checkpoint writes the step again: a new completion marker) is ingested again, so that its
snapshot, tokens and shards follow the policy directory that now holds the second write:
the listing gives each marker's version (its ETag on S3), the cursor remembers the version
of the newest :data:`SEEN_STEPS` steps, and a step whose marker changed is requested with
the run key ``step-NNNNNN@<version digest>`` once no ingest of it is queued or running
(two runs never write one step's datasets at once). A rewrite of an older step, or one made
while the cursor was lost, is not seen: re-run that partition by hand.

Per tick: one listing of the snapshot root and one of the shards root, one query of the
job's runs by partition and one query of materialized partitions per data asset, however
long the history (no per-step lookups). Besides the versions, the cursor holds the steps
requested by the previous tick whose run did not exist yet (a daemon creates them at once;
in-process callers may not), so a lost cursor can repeat only those, which run keys
deduplicate.
"""

import hashlib
import json
from collections.abc import Iterable, Mapping

from dagster import (
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)

from assets.groups import DATA_ASSETS, MONITOR_ASSETS
from assets.partitions import (
    ingested_steps,
    odd_keys_note,
    odd_partition_keys,
    parse_step,
    rl_steps,
    step_key,
)
from pipeline.layout import ROLLOUTS, SHARDS, committed_steps, committed_versions, odd_entries
from resources.run_config import run_config_from_env
from resources.storage import StorageResource

# the deployment's run config (AERIE_INGEST_RUN_CONFIG), carried by every request too
INGEST_RUN_CONFIG = run_config_from_env("AERIE_INGEST_RUN_CONFIG") or None

ingest_step = define_asset_job(
    "ingest_step", selection=[*DATA_ASSETS, *MONITOR_ASSETS], config=INGEST_RUN_CONFIG,
    description="One RL step's data path: validate the snapshot, tokenize with loss masks, "
                "capture hidden states into shards; and the acceptance the RL engine "
                "observed with the serving drafter (partition = step).")

NOT_DONE = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED, DagsterRunStatus.CANCELING)
FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
ODD_NAMES_SHOWN = 5
SEEN_STEPS = 64  # the newest steps whose marker versions the cursor keeps


def plan_ingest(completed: Iterable[int], runs: Mapping[int, DagsterRunStatus],
                ingested: Iterable[int], pending: Iterable[int]) -> tuple[list[int], list[int]]:
    """``(steps to request, the new pending list)`` from the completed snapshot steps, the
    latest ingest run status per step, the ingested steps and the previous tick's pending
    steps (requested, no run seen yet)."""
    ingested = set(ingested)
    done = ingested | {s for s, status in runs.items() if status not in NOT_DONE}
    waiting = {s for s in pending if s not in runs and s not in ingested}
    request = [s for s in sorted(set(completed)) if s not in done and s not in waiting]
    return request, sorted(waiting | set(request))


def plan_rewrites(versions: Mapping[int, str], seen: Mapping[int, str],
                  runs: Mapping[int, DagsterRunStatus], pending: Iterable[int]
                  ) -> tuple[list[int], dict[int, str]]:
    """``(rewritten steps to ingest again, the versions to remember)`` from the marker
    version of every completed step, the versions remembered by the previous tick, the
    newest ingest run's status per step and the steps requested but not yet run. A step
    seen for the first time is only remembered (:func:`plan_ingest` requests it); a changed
    one is requested once its newest run finished, and remembered at its new version then."""
    waiting = set(pending)
    rewritten, remembered = [], {}
    for step in sorted(versions)[-SEEN_STEPS:]:
        version, before = versions[step], seen.get(step)
        if before is None or before == version:
            remembered[step] = version
        elif step in runs and runs[step] in FINISHED and step not in waiting:
            rewritten.append(step)
            remembered[step] = version
        else:  # its ingest is queued or running (or not created yet): look again next tick
            remembered[step] = before
    return rewritten, remembered


def rewrite_run_key(step: int, version: str) -> str:
    return f"{step_key(step)}@{hashlib.sha256(version.encode()).hexdigest()[:12]}"


def ingest_runs(instance) -> dict[int, DagsterRunStatus]:
    """The status of the newest ``ingest_step`` run of every partition (one query)."""
    found = ((parse_step(r.partition), r.status) for r in instance.get_run_partition_data(
        RunsFilter(job_name=ingest_step.name)))
    return {step: status for step, status in found if step is not None}


def skipped_note(odd: list[str]) -> str:
    """A one-line account of the entries under ``rollouts/`` that are not step directories
    (at most :data:`ODD_NAMES_SHOWN` named, each shortened and escaped)."""
    shown = ", ".join(repr(n[:40]) for n in odd[:ODD_NAMES_SHOWN])
    more = f" and {len(odd) - ODD_NAMES_SHOWN} more" if len(odd) > ODD_NAMES_SHOWN else ""
    return (f"skipped {len(odd)} entries under {ROLLOUTS}/ that are not step directories "
            f"(step=NNNNNN): {shown}{more}")


def _pending(cursor: str | None) -> list[int]:
    """The cursor's pending steps; an older cursor (the newest step seen) holds none."""
    value = json.loads(cursor) if cursor else None
    return list(value.get("pending", [])) if isinstance(value, dict) else []


def _seen(cursor: str | None) -> dict[int, str]:
    """The marker versions the cursor remembers (none in an older cursor)."""
    value = json.loads(cursor) if cursor else None
    seen = value.get("seen", {}) if isinstance(value, dict) else {}
    return {int(k): str(v) for k, v in seen.items()} if isinstance(seen, dict) else {}


@sensor(job=ingest_step, minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.STOPPED,
        description="Every 30 s: finds the RL steps whose snapshot the trainer finished "
                    "(its manifest) and runs ingest_step for each one not ingested yet.")
def snapshot_sensor(context: SensorEvaluationContext, storage: StorageResource):
    """Adds a partition and requests one ingest run per completed, not yet ingested snapshot
    step (see the module docstring); the run key is the partition key."""
    store = storage.checked()
    versions = store.list_versions(ROLLOUTS)
    markers = committed_versions(versions, ROLLOUTS)  # the completion markers of step dirs
    odd = odd_entries(versions, ROLLOUTS)
    if odd:
        context.log.warning(skipped_note(odd))
    odd_keys = odd_partition_keys(context.instance)
    if odd_keys:
        context.log.warning(odd_keys_note(odd_keys))
    runs, previous = ingest_runs(context.instance), _pending(context.cursor)
    ingested = {*ingested_steps(context.instance),
                *committed_steps(store.list(SHARDS), SHARDS)}
    steps, pending = plan_ingest(markers, runs, ingested, previous)
    rewritten, seen = plan_rewrites(markers, _seen(context.cursor), runs, previous)
    if rewritten:
        context.log.info(f"steps rewritten since they were ingested, ingested again: "
                         f"{rewritten}")
    requests = {s: step_key(s) for s in steps} | {
        s: rewrite_run_key(s, markers[s]) for s in rewritten}
    cursor = json.dumps({"pending": sorted(set(pending) | set(rewritten)),
                         "seen": {str(k): v for k, v in sorted(seen.items())}})
    if not requests:
        note = "".join(f"; {n}" for n in ([skipped_note(odd)] if odd else [])
                       + ([odd_keys_note(odd_keys)] if odd_keys else []))
        return SensorResult(skip_reason=SkipReason(
            f"all {len(markers)} completed snapshot steps are ingested or being "
            f"ingested{note}"), cursor=cursor)
    keys = [step_key(s) for s in sorted(requests)]
    return SensorResult(
        run_requests=[RunRequest(run_key=requests[s], partition_key=step_key(s),
                                 run_config=INGEST_RUN_CONFIG or {}) for s in sorted(requests)],
        dynamic_partitions_requests=[rl_steps.build_add_request(keys)],
        cursor=cursor,
    )
