"""Triggers of the drafter refresh: every N ingested RL steps (sensor) or on a cron (schedule).

A refresh at step s trains on the window s-K+1..s. N and K come from the ``refresh``
resource (:class:`resources.refresh.RefreshPolicyResource`; env ``AERIE_REFRESH_EVERY``,
``AERIE_REFRESH_WINDOW``); K reaches the run as typed run config. The sensor requests one
when another block of N steps has been ingested since the last refresh: refreshes land on
steps N-1, 2N-1, ... (the newest ingested step when the block completes, if ingestion
jumped ahead).
Exactly once: every refresh run carries the tag ``aerie/refresh_step``; both triggers treat a
step some run was launched for (any status) as done, so the sensor after a lost cursor, and the
schedule next to the sensor, never request it again (a failed refresh is re-run by hand, not
every hour). Run keys are ``drafter-refresh-<partition>`` on top. Never two at once: both skip
while a refresh run is queued or running. Cursor: ``{"last": s}``, the step of the last
requested refresh; the sensor counts blocks from the newer of it and the newest tagged run.

Partitions: the refresh assets have their own (``refresh_steps``, see
:mod:`assets.partitions`); the sensor adds the refresh step's key in the same result as the
run request (``AddDynamicPartitionsRequest``), the schedule, which cannot return one, adds it
to the instance before returning its request.
"""

import json

from dagster import (
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
from assets.partitions import (
    REFRESH_STEP_TAG,
    TRIGGER_TAG,
    ensure_partition,
    ingested_steps,
    odd_keys_note,
    odd_partition_keys,
    parse_step_tag,
    refresh_steps,
    step_key,
)
from jobs.drafter import DEFAULT_RUN_CONFIG, drafter_refresh
from pipeline.release.mlflow_registry import model_name
from pipeline.serving_now import read_serving
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.run_config import deep_merge
from resources.storage import StorageResource

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED]


def due_refresh(ingested: list[int], last: int, every: int, window: int = 1) -> int | None:
    """The step to refresh at, or None: once the block of ``every`` steps after the last
    refresh (``last``; -1 for none) is passed, the newest ingested step whose whole window
    (its last ``window`` steps) is ingested. A step that finishes ingesting after a later
    one holds the refresh back until it is in, so no refresh is asked for a window that
    cannot train and no block is skipped."""
    if every < 1:
        return None
    boundary = (last + 1) // every
    due = [s for s in ingested if (s + 1) // every > boundary]
    return newest_complete(due, set(ingested), window)


def newest_complete(candidates: list[int], ingested: set[int], window: int) -> int | None:
    """The newest of ``candidates`` whose window (the ``window`` steps ending at it, from
    step 0 on) is all in ``ingested``; None when none is."""
    for step in sorted(candidates, reverse=True):
        if all(s in ingested for s in range(max(0, step - max(window, 1) + 1), step + 1)):
            return step
    return None


DRIFT_VERSION_TAG = "aerie/drifted_version"  # the serving version a drift refresh replaces


def drift_fired(instance) -> dict[str, int]:
    """The serving versions a drift refresh was launched for (whatever became of it), each
    with the step of its newest such refresh."""
    runs = instance.get_runs(filters=RunsFilter(job_name=drafter_refresh.name,
                                                tags={TRIGGER_TAG: "drift"}))
    fired: dict[str, int] = {}
    for run in runs:
        version = run.tags.get(DRIFT_VERSION_TAG)
        step = parse_step_tag(run.tags.get(REFRESH_STEP_TAG))
        if version is not None and step is not None:
            fired[version] = max(fired.get(version, -1), step)
    return fired


def refresh_request(step: int, window: int | None = None, trigger: str = "cadence",
                    tags: dict[str, str] | None = None) -> RunRequest:
    """The run of the refresh at ``step``: the job's default run config (the family's
    training preset) plus the window; ``window`` None leaves K to the refresh resource.
    Whatever ``trigger`` asked for it, the run key is the step's: one refresh per step."""
    key = step_key(step)
    vocab = RunConfig(ops={"vocab_mapping": VocabRunConfig(window=window)}).to_config_dict()
    return RunRequest(run_key=f"drafter-refresh-{key}", partition_key=key,
                      run_config=deep_merge(DEFAULT_RUN_CONFIG or {}, vocab),
                      tags={REFRESH_STEP_TAG: str(step), TRIGGER_TAG: trigger, **(tags or {})})


def requesting(request: RunRequest, cursor: str) -> SensorResult:
    """A sensor's result that requests ``request`` and adds its refresh partition with it."""
    return SensorResult(run_requests=[request], cursor=cursor, dynamic_partitions_requests=[
        refresh_steps.build_add_request([request.partition_key])])


def requested_steps(instance) -> set[int]:
    """Steps a refresh run was launched for, whatever became of it."""
    found = (parse_step_tag(v) for _, values in
             instance.get_run_tags(tag_keys=[REFRESH_STEP_TAG]) for v in values)
    return {s for s in found if s is not None}  # a tag Aerie did not write is no step


def refresh_in_flight(instance) -> bool:
    return bool(instance.get_run_records(
        RunsFilter(job_name=drafter_refresh.name, statuses=IN_FLIGHT), limit=1))


@sensor(job=drafter_refresh, minimum_interval_seconds=60,
        default_status=DefaultSensorStatus.STOPPED,
        description="Every 60 s: once another N RL steps are ingested (AERIE_REFRESH_EVERY; "
                    "up to AERIE_REFRESH_MAX_INTERVAL while the serving drafter's observed τ "
                    "holds), runs one drafter_refresh on the last K (AERIE_REFRESH_WINDOW); "
                    "never two at once, never twice for a step.")
def refresh_sensor(context: SensorEvaluationContext, refresh: RefreshPolicyResource,
                   storage: StorageResource, mlflow: MlflowResource):
    """Requests one drafter refresh per completed block of N ingested steps."""
    last = max(json.loads(context.cursor)["last"] if context.cursor else -1,
               max(requested_steps(context.instance), default=-1))
    step = due_refresh(ingested_steps(context.instance), last, refresh.every, refresh.window)
    odd = odd_partition_keys(context.instance)
    if odd:
        context.log.warning(odd_keys_note(odd))
    if step is None:
        note = f"; {odd_keys_note(odd)}" if odd else ""
        return SkipReason(f"no new block of {refresh.every} ingested steps since step "
                          f"{last}{note}")
    if refresh.max_interval > refresh.every and step - last < refresh.max_interval:
        from pipeline.monitor.drift import healthy, serving_reading

        r = serving_reading(storage.build(), model_name(mlflow.target_family),
                            refresh.drift_window, step)
        if healthy(r, refresh.drift_policy()):
            return SkipReason(f"cadence stretched: {r.describe()}; the next refresh by step "
                              f"{last + refresh.max_interval} (AERIE_REFRESH_MAX_INTERVAL)")
    if refresh_in_flight(context.instance):
        return SkipReason("a drafter refresh is still queued or running")
    return requesting(refresh_request(step, refresh.window), json.dumps({"last": step}))


@schedule(job=drafter_refresh, cron_schedule="0 * * * *",
          default_status=DefaultScheduleStatus.STOPPED,
          description="Hourly alternative to refresh_sensor: refreshes the newest ingested "
                      "RL step unless a refresh was already launched for it.")
def drafter_refresh_schedule(context: ScheduleEvaluationContext,
                             refresh: RefreshPolicyResource):
    """The alternative trigger: hourly, refresh the newest ingested step unless a refresh
    run was already launched for it."""
    steps = ingested_steps(context.instance)
    step = newest_complete(steps, set(steps), refresh.window)
    if step is None:
        return SkipReason("no ingested RL step with its whole window ingested yet")
    if step in requested_steps(context.instance):
        return SkipReason(f"a refresh run for step {step} was already launched")
    if refresh_in_flight(context.instance):
        return SkipReason("a drafter refresh is still queued or running")
    ensure_partition(context.instance, refresh_steps, step_key(step))
    return refresh_request(step, refresh.window, trigger="schedule")


@sensor(job=drafter_refresh, minimum_interval_seconds=60,
        default_status=DefaultSensorStatus.STOPPED,
        description="Every 60 s: when the serving drafter's τ as the RL engine observed it "
                    "(serving_acceptance, over AERIE_DRIFT_WINDOW steps) fell more than "
                    "AERIE_MAX_TAU_DROP_PERCENT below its τ at promotion, runs a "
                    "drafter_refresh at the newest ingested step now; once per drop.")
def drift_sensor(context: SensorEvaluationContext, refresh: RefreshPolicyResource,
                 storage: StorageResource, mlflow: MlflowResource):
    """Requests a refresh when the serving drafter drifted (pipeline.monitor.drift). Cursor:
    ``{"version": v, "armed": bool}``, the drafter it watched and whether it may fire.
    Without it (lost, or another drafter): armed, unless a drift refresh was launched for
    this drafter (run tag ``aerie/drifted_version``) and no reading since was back within
    the re-arm threshold: never two refreshes for one drop."""
    from pipeline.monitor import drift

    steps = ingested_steps(context.instance)
    if not steps:
        return SkipReason("no ingested RL step yet")
    newest, policy = steps[-1], refresh.drift_policy()
    w = drift.watch(storage.build(), model_name(mlflow.target_family))
    r = w.reading(policy.window, newest) if w is not None else None
    cursor = json.loads(context.cursor) if context.cursor else {}
    version = r.version if r is not None else None
    if cursor and cursor.get("version") == version:
        armed = cursor.get("armed", True)
    else:
        fired = drift_fired(context.instance).get(version) if version else None
        armed = fired is None or w.recovered_after(fired, policy)
    requested = requested_steps(context.instance)
    verdict = drift.decide(r, policy, armed=armed, newest_step=newest,
                           last_refresh_step=max(requested, default=None))
    after = json.dumps({"version": version, "armed": verdict.armed})
    if not verdict.trigger:
        return SensorResult(skip_reason=verdict.reason, cursor=after)
    canary = read_serving(storage.build(), model_name(mlflow.target_family))
    if canary is not None and canary.canary is not None:  # fire on a later tick, still armed
        return SkipReason(f"{verdict.reason}; waiting: canary {canary.canary.target.name} "
                          f"serves part of the servers, and its verdict comes first")
    at = newest_complete(steps, set(steps), refresh.window)  # a window that can train
    if at is None:  # fire on a later tick, still armed
        return SkipReason(f"{verdict.reason}; waiting: no ingested step has its whole "
                          "window ingested yet")
    if at in requested:
        return SensorResult(skip_reason=f"{verdict.reason}; a refresh at step {at} was "
                                        f"launched already", cursor=after)
    if refresh_in_flight(context.instance):  # fire on a later tick, still armed
        return SkipReason(f"{verdict.reason}; waiting: a drafter refresh is still running")
    return requesting(refresh_request(at, refresh.window, "drift",
                                      {DRIFT_VERSION_TAG: version}), after)
