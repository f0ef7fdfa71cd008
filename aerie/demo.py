"""The refresh loop of the embedded default, driven one RL step at a time.

After the RL trainer writes a step, :meth:`RefreshLoop.after_step` does what the daemon does
on its next ticks: it ticks ``snapshot_sensor`` and runs the ``ingest_step`` runs it asks
for, then ticks ``refresh_sensor`` (every N ingested steps) and runs the ``drafter_refresh``
it asks for. Runs are created with the code location's origin (:mod:`aerie.launch`), so
they show on their job pages as launched by their sensor. ``aerie demo`` and the e2e tests
use it; :func:`refresh_outcomes` reads back what each refresh decided.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dagster import AssetKey, DagsterInstance, DagsterRun, RunRequest, build_sensor_context

from aerie import launch
from aerie.launch import definitions, record_tick
from assets.partitions import TRIGGER_TAG, step_of
from assets.release import GATE_ACTOR
from resources.refresh import RefreshPolicyResource
from resources.run_config import deep_merge

log = logging.getLogger("aerie")
SENSOR_TAG = "dagster/sensor_name"  # what the daemon tags a sensor's runs with
SCHEDULE_TAG = "dagster/schedule_name"

# The demo world has 16 prompts per RL step: hold out a fifth of them (not the library's 5%)
# so that evaluation has a few dozen prompts no drafter ever trained on.
DEMO_INGEST_CONFIG = {"ops": {"hidden_state_shards": {"config": {"heldout_fraction": 0.2}}}}


def apply_tick(instance: DagsterInstance, job_name: str, result, run_config: dict | None,
               launched_by: dict[str, str], verbose: bool = False) -> list[DagsterRun]:
    """Apply a tick's partition requests, execute its run requests and record the tick, as
    the daemon does with a sensor's or a schedule's result (a SensorResult, a SkipReason or
    a lone RunRequest); ``launched_by`` names the sensor or schedule (run tags)."""
    started = time.time()
    for add in getattr(result, "dynamic_partitions_requests", None) or []:
        instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
    requests = [result] if isinstance(result, RunRequest) else \
        getattr(result, "run_requests", None)
    kind, name = ("sensor", launched_by[SENSOR_TAG]) if SENSOR_TAG in launched_by else \
        ("schedule", launched_by[SCHEDULE_TAG])
    skip = getattr(result, "skip_message", None) or getattr(
        getattr(result, "skip_reason", None), "skip_message", None)
    created: list[DagsterRun] = []
    try:  # the tick launched the runs it created, whether they succeed or not
        execute_requests(instance, job_name, requests, run_config, launched_by, verbose,
                         created)
    finally:
        record_tick(instance, name, kind, started, created, skip or "nothing new",
                    getattr(result, "cursor", None))
    return created


def execute_requests(instance: DagsterInstance, job_name: str, requests,
                     run_config: dict | None = None,
                     launched_by: dict[str, str] | None = None, verbose: bool = False,
                     created: list[DagsterRun] | None = None) -> list[DagsterRun]:
    """Execute run requests in this process, as the daemon would launch them.

    ``run_config`` is deep-merged over each request's own. The request's partition is added
    to the job's dynamic partitions if missing (a daemon refuses a request for an unknown
    partition). Partitions whose job assets are all materialized already are skipped (what
    the daemon's run-key dedup does across restarts). Returns the runs; ``created`` also
    collects each run as soon as it exists (a failed run raises :class:`RunFailed`).
    """
    from assets.partitions import complete_partitions, ensure_partition

    job = definitions().resolve_job_def(job_name)
    done = complete_partitions(instance, job.asset_layer.executable_asset_keys)
    runs = []
    for request in requests or []:
        if request.partition_key in done:
            log.info("%s %s: already materialized", job_name, request.partition_key)
            continue
        ensure_partition(instance, job.partitions_def, request.partition_key)
        config = deep_merge(deep_merge(request.run_config or {}, run_config or {}),
                            launch.in_process(verbose))
        run = launch.execute(instance, job_name, request, config, launched_by or {}, created)
        log.info("%s %s: run %s succeeded", job_name, request.partition_key, run.run_id)
        runs.append(run)
    return runs


# The demo's serving: a drafter the gate passes serves first as a canary on half of the
# demo trainer's four rollout servers, and is judged on its next three RL steps
# (AERIE_SERVING_CANARY_SHARE=0 promotes at once); the trainer reports counters for
# DEMO_REPORTED_PROMPTS prompts per step, two per server.
DEMO_SERVING = {"AERIE_SERVING_CANARY_SHARE": "0.5", "AERIE_SERVING_CANARY_STEPS": "3",
                "AERIE_SERVING_CANARY_MIN_VERIFY_PASSES": "100"}
DEMO_REPORTED_PROMPTS = 8


def reported_records(out, storage, max_new_tokens: int, prompts: int = 4) -> list[dict]:
    """Step ``out``'s records as the demo trainer reports them: with the speculative counters
    its engine would have had with the drafter serving now (:mod:`pipeline.demo.speculation`;
    the records as they are while none serves)."""
    from pipeline.demo.speculation import with_counters
    from pipeline.release.mlflow_registry import model_name
    from resources.home import aerie_home

    return with_counters(out.records, out.policy_dir, storage,
                         model_name(definitions().resources["mlflow"].target_family),
                         aerie_home() / "serving-cache", sampling=out.sampling,
                         max_new_tokens=max_new_tokens, prompts=prompts, seed=out.step)


@dataclass
class RefreshLoop:
    """The sensors' cursors and what they launched. ``refresh_config(step)`` is the run
    config merged into the refresh at RL step ``step``, if any; ``policy`` the refresh
    resource the sensors see (default: the definitions', from the environment)."""

    instance: DagsterInstance
    refresh_config: Callable[[int], dict | None] = lambda n: None
    verbose: bool = False
    policy: RefreshPolicyResource | None = None
    snapshot_cursor: str | None = None
    refresh_cursor: str | None = None
    ingested: list[str] = field(default_factory=list)
    refreshed: list[str] = field(default_factory=list)
    refresh_ticks: list[str] = field(default_factory=list)  # "run" / "skip" per tick
    drift_cursor: str | None = None
    drift_ticks: list[str] = field(default_factory=list)  # "run" / why it skipped, per tick
    triggers: dict[str, str] = field(default_factory=dict)  # refresh partition -> trigger

    def __post_init__(self) -> None:
        for run_id in launch.fail_orphaned_runs(self.instance):
            log.warning("run %s was left in flight by a process that died: marked failed",
                        run_id)

    def ingest(self) -> list[str]:
        """Tick ``snapshot_sensor`` and run the ``ingest_step`` runs it requests."""
        from jobs.snapshots import snapshot_sensor

        tick = snapshot_sensor(build_sensor_context(
            instance=self.instance, cursor=self.snapshot_cursor,
            resources={"storage": definitions().resources["storage"]}))
        self.snapshot_cursor = tick.cursor or self.snapshot_cursor
        runs = apply_tick(self.instance, "ingest_step", tick, DEMO_INGEST_CONFIG,
                          {SENSOR_TAG: snapshot_sensor.name}, self.verbose)
        ran = [r.tags["dagster/partition"] for r in runs]
        self.ingested += ran
        return ran

    def refresh(self) -> list[str]:
        """Tick ``refresh_sensor`` and run the ``drafter_refresh`` it requests, if any."""
        from jobs.refresh import refresh_sensor

        tick = refresh_sensor(build_sensor_context(
            instance=self.instance, cursor=self.refresh_cursor, resources=self._resources()))
        requests = getattr(tick, "run_requests", None) or []
        self.refresh_ticks.append("run" if requests else "skip")
        if requests:
            self.refresh_cursor = tick.cursor
        return self._refresh(tick, {SENSOR_TAG: refresh_sensor.name})

    def drift(self) -> list[str]:
        """Tick ``drift_sensor`` and run the ``drafter_refresh`` it requests, if any."""
        from jobs.refresh import drift_sensor

        tick = drift_sensor(build_sensor_context(
            instance=self.instance, cursor=self.drift_cursor, resources=self._resources()))
        self.drift_cursor = getattr(tick, "cursor", None) or self.drift_cursor
        requests = getattr(tick, "run_requests", None) or []
        skip = getattr(tick, "skip_message", None) or getattr(
            getattr(tick, "skip_reason", None), "skip_message", None)
        self.drift_ticks.append("run" if requests else str(skip))
        return self._refresh(tick, {SENSOR_TAG: drift_sensor.name})

    def _resources(self) -> dict:
        defs = definitions()
        return {"refresh": self.policy or defs.resources["refresh"],
                "storage": defs.resources["storage"], "mlflow": defs.resources["mlflow"]}

    def refresh_newest(self) -> list[str]:
        """Tick ``drafter_refresh_schedule`` (refresh the newest ingested step unless a
        refresh was launched for it) and run what it requests."""
        from dagster import build_schedule_context

        from jobs.refresh import drafter_refresh_schedule

        tick = drafter_refresh_schedule(build_schedule_context(
            instance=self.instance, resources=self._resources()))
        return self._refresh(tick, {SCHEDULE_TAG: drafter_refresh_schedule.name})

    def _refresh(self, tick, launched_by: dict[str, str]) -> list[str]:
        requests = [tick] if isinstance(tick, RunRequest) else \
            getattr(tick, "run_requests", None) or []
        config = self.refresh_config(step_of(requests[0].partition_key)) if requests else None
        runs = apply_tick(self.instance, "drafter_refresh", tick, config, launched_by,
                          self.verbose)
        ran = [r.tags["dagster/partition"] for r in runs]
        self.refreshed += ran
        for r in runs:
            self.triggers[r.tags["dagster/partition"]] = r.tags.get(TRIGGER_TAG, "cadence")
        return ran

    def after_step(self) -> list[str]:
        """What the daemon's next ticks do once a step is written: ingest, then refresh if
        another block of N steps is in, else if the serving drafter drifted. Returns the
        refresh partitions that ran."""
        self.ingest()
        return self.refresh() or self.drift()


@dataclass(frozen=True)
class RefreshOutcome:
    """One refresh as the gate saw it (read back from ``serving_drafter``'s event)."""

    partition: str
    window: list[int]
    version: str
    fingerprint: str
    candidate_tau: float
    champion_tau: float | None  # None: no champion yet (measured against no drafter)
    no_drafter_tau: float | None
    action: str
    champion_after: str
    reasons: list[str]
    regime: str = "greedy"  # the sampler τ was measured at


def refresh_outcomes(instance: DagsterInstance, partitions: list[str]) -> list[RefreshOutcome]:
    """The gate's decision of every refresh in ``partitions`` that reached the gate."""
    found = (gate_outcome(instance, p) for p in partitions)
    return [o for o in found if o is not None]


def asset_events(instance: DagsterInstance, asset: str, partition: str, limit: int = 20):
    """``(run id, metadata)`` of the newest events of ``asset`` on ``partition``, newest first:
    materializations and observations (``serving_drafter`` observes a decision that left the
    champion where it was)."""
    from dagster import AssetRecordsFilter

    where = AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition])
    records = sorted([*instance.fetch_materializations(where, limit=limit).records,
                      *instance.fetch_observations(where, limit=limit).records],
                     key=lambda r: r.storage_id, reverse=True)[:limit]
    return [(r.run_id, {k: v.value for k, v in r.asset_event.metadata.items()})
            for r in records]


def gate_outcome(instance: DagsterInstance, partition: str, run_id: str | None = None
                 ) -> RefreshOutcome | None:
    """The gate's newest decision on ``partition`` (in run ``run_id``, if given), or None
    when no refresh of it reached the gate."""
    gate = [(r, m) for r, m in asset_events(instance, "serving_drafter", partition)
            if m.get("actor") == GATE_ACTOR and run_id in (None, r)]
    if not gate:
        return None
    run, serving = gate[0]
    registered = _of_run(asset_events(instance, "registered_drafter", partition), run)
    evaluation = _of_run(asset_events(instance, "acceptance_eval", partition), run)
    return RefreshOutcome(
        partition=partition, window=list(registered["window_steps"]),
        version=str(registered["version"]), fingerprint=str(registered["fingerprint"]),
        candidate_tau=float(evaluation["candidate_tau"]),
        champion_tau=evaluation.get("champion_tau"),
        no_drafter_tau=evaluation.get("no_drafter_tau"),
        action=str(serving["action"]), champion_after=str(serving["champion"]),
        reasons=[line.removeprefix("- ") for line in str(serving["reasons"]).splitlines()],
        regime=str(evaluation.get("regime", "greedy")))


def _of_run(events: list[tuple[str, dict]], run_id: str) -> dict:
    """The event of run ``run_id`` (the refresh's own), else the newest one (a re-run of the
    gate alone)."""
    return next((m for r, m in events if r == run_id), events[0][1] if events else {})
