"""The drift trigger, stepped through synthetic τ series: one refresh per drop (hysteresis,
cooldown, run keys), and the cadence stretched only while the serving drafter holds up."""

from __future__ import annotations

import pytest
from dagster import (
    DagsterRunStatus,
    SensorResult,
    SkipReason,
    build_sensor_context,
    instance_for_test,
)

from assets.partitions import step_key
from jobs.refresh import drift_sensor, refresh_sensor
from pipeline.monitor import drift
from pipeline.monitor.drift import DriftPolicy, Reading, decide, healthy, reading
from pipeline.monitor.observed import rollout_counts, summarise
from resources.refresh import RefreshPolicyResource
from tests.orchestration.conftest import (
    ingest,
    on_every_dagster_backend,
    refresh_job,
    trigger_resources,
)

REFERENCE = 2.0  # the serving drafter's τ at promotion
POLICY = DriftPolicy(max_drop=0.10, window=1, rearm_drop=0.05, cooldown_steps=2,
                     min_cycles=50)


def _step(step: int, tau: float, cycles: int = 100, version: str = "1"):
    """Step ``step``'s summary: ``cycles`` verify passes at τ ``tau`` by one rollout."""
    spec = {"drafter_version": version, "verify_ct": cycles,
            "completion_tokens": round(tau * cycles) + 1}
    return summarise(step, [spec, None])


def test_counts_of_a_rollout_and_a_step():
    assert rollout_counts({"verify_ct": 4, "completion_tokens": 11}) == (10, 4)
    assert rollout_counts({"verify_ct": 4, "completion_tokens": None,
                           "accepted_tokens": 6}) == (10, 4)  # each pass adds its bonus
    s = summarise(7, [{"drafter_version": "2", "verify_ct": 4, "completion_tokens": 11},
                      {"drafter_version": "2", "verify_ct": 6, "completion_tokens": 7}, None])
    (v,) = s.versions
    assert (s.rollouts, s.with_counters, v.verify_ct, v.emitted) == (3, 2, 10, 16)
    assert v.tau == pytest.approx(1.6) and v.tau_low <= v.tau <= v.tau_high
    assert s.of("1") is None


def test_a_reading_sums_the_last_window_of_steps_the_drafter_drafted():
    series = [_step(3, 2.0), _step(4, 1.0, version="0"), _step(5, 1.5), _step(6, 1.7)]
    r = reading(series, "1", REFERENCE, window=2)
    assert r.steps == (5, 6) and r.tau == pytest.approx(1.6) and r.drop == pytest.approx(0.2)
    assert reading(series, "1", REFERENCE, window=2, newest_step=5).steps == (3, 5)


def _walk(taus: dict[int, float], policy: DriftPolicy = POLICY) -> list[int]:
    """Steps at which the trigger fires over a τ series, refreshing where it fires."""
    armed, last_refresh, fired, series = True, None, [], []
    for step, tau in sorted(taus.items()):
        series.append(_step(step, tau))
        v = decide(reading(series, "1", REFERENCE, policy.window), policy, armed=armed,
                   newest_step=step, last_refresh_step=last_refresh)
        armed = v.armed
        if v.trigger:
            fired.append(step)
            last_refresh = step
    return fired


def test_one_trigger_per_drop_with_hysteresis():
    # falls at 3, stays low (no second trigger), recovers at 6 (re-armed), falls again at 8
    taus = {0: 2.0, 1: 1.95, 2: 1.9, 3: 1.7, 4: 1.6, 5: 1.75, 6: 1.95, 7: 1.98, 8: 1.7,
            9: 1.6}
    assert _walk(taus) == [3, 8]
    # hovering between the thresholds never re-arms
    assert _walk({0: 1.7, 1: 1.85, 2: 1.86, 3: 1.7, 4: 1.85, 5: 1.7}) == [0]


def test_cooldown_and_thin_readings_hold_the_trigger():
    policy = DriftPolicy(max_drop=0.10, window=1, rearm_drop=0.05, cooldown_steps=3,
                         min_cycles=50)
    r = Reading("1", REFERENCE, (5,), emitted=140, cycles=100)
    assert not decide(r, policy, armed=True, newest_step=5, last_refresh_step=3).trigger
    assert decide(r, policy, armed=True, newest_step=6, last_refresh_step=3).trigger
    thin = Reading("1", REFERENCE, (5,), emitted=14, cycles=10)
    v = decide(thin, policy, armed=True, newest_step=9, last_refresh_step=None)
    assert not v.trigger and v.armed and "fewer than 50" in v.reason
    assert decide(None, policy, armed=False, newest_step=9, last_refresh_step=None).armed
    assert not healthy(thin, policy) and not healthy(None, policy)
    assert healthy(Reading("1", REFERENCE, (5,), 190, 100), policy)


def _tick(sensor, instance, cursor, policy):
    return sensor(build_sensor_context(instance=instance, cursor=cursor,
                                       resources=trigger_resources(policy)))


def _launch(instance, request) -> None:
    """What the daemon does with a request: a run with its tags (its run key dedups)."""
    instance.create_run_for_job(job_def=refresh_job(), run_id=None, tags=request.tags,
                                status=DagsterRunStatus.SUCCESS)


def _drive(instance, taus: dict[int, float], policy, series, keep_cursor_until: int = 99):
    """Tick the drift sensor after each step of ``taus``, launching what it requests; from
    step ``keep_cursor_until`` on its cursor is lost at every tick. Also checks that a tick
    without the cursor never requests what the one with it did not."""
    requested, cursor, done = [], None, -1
    for step, tau in taus.items():
        ingest(instance, *range(done + 1, step + 1))  # every step so far, read or not
        done = step
        series.append(_step(step, tau))
        if step >= keep_cursor_until:
            cursor = None
        result = _tick(drift_sensor, instance, cursor, policy)
        cursor = result.cursor
        for request in result.run_requests or []:
            requested.append(request)
            _launch(instance, request)
        assert not _tick(drift_sensor, instance, None, policy).run_requests
    return requested


@pytest.fixture
def watched(monkeypatch):
    """The drafter serving now is v1 at τ 2.0 at promotion; what it observed is the list."""
    series = []
    monkeypatch.setattr(drift, "watch", lambda storage, name: drift.Watch(
        "1", REFERENCE, tuple(series)))
    return series


@pytest.mark.integration
def test_the_drift_sensor_fires_once_per_drop_through_its_cursor(dagster_backend, watched):
    taus = {3: 1.98, 4: 1.97, 5: 1.7, 6: 1.65, 7: 1.7, 8: 1.96, 9: 1.97, 10: 1.6, 11: 1.6}
    policy = RefreshPolicyResource(every=100, drift_window=1, drift_cooldown_steps=2)
    with instance_for_test(overrides=dagster_backend) as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(12)])
        requested = _drive(instance, taus, policy, watched)
    assert [r.partition_key for r in requested] == ["step-000005", "step-000010"]
    assert [r.run_key for r in requested] == ["drafter-refresh-step-000005",
                                              "drafter-refresh-step-000010"]
    assert all(r.tags["aerie/refresh_trigger"] == "drift" and
               r.tags["aerie/drifted_version"] == "1" for r in requested)


@pytest.mark.integration
@pytest.mark.parametrize("taus, fired", [
    # recovered at 8, then the cursor is lost for good: the second drop still fires, once
    ({3: 1.98, 5: 1.7, 6: 1.7, 8: 1.96, 9: 1.97, 10: 1.6, 11: 1.6, 12: 1.6}, [5, 10]),
    # never recovered: however often the cursor is lost, one refresh for the one drop
    ({3: 1.98, 5: 1.7, 6: 1.7, 8: 1.8, 9: 1.75, 10: 1.6, 11: 1.6, 12: 1.6}, [5]),
])
@on_every_dagster_backend
def test_a_lost_cursor_rebuilds_the_arming_from_the_runs_and_readings(
        dagster_backend, watched, taus, fired):
    policy = RefreshPolicyResource(every=100, drift_window=1, drift_cooldown_steps=2)
    with instance_for_test(overrides=dagster_backend) as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(13)])
        requested = _drive(instance, taus, policy, watched, keep_cursor_until=7)
    assert [int(r.partition_key[-6:]) for r in requested] == fired


@pytest.mark.integration
def test_the_cadence_stretches_only_while_the_drafter_holds_up(dagster_backend, monkeypatch):
    state = {"tau": 1.95}
    monkeypatch.setattr(drift, "serving_reading", lambda storage, name, window, newest: (
        Reading("1", REFERENCE, (newest,), round(state["tau"] * 100), 100)))
    policy = RefreshPolicyResource(every=4, max_interval=8)
    with instance_for_test(overrides=dagster_backend) as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(12)])
        ingest(instance, *range(4))
        first = _tick(refresh_sensor, instance, None, policy)  # a healthy drafter: wait
        assert isinstance(first, SkipReason) and "cadence stretched" in str(first)
        ingest(instance, *range(4, 8))
        due = _tick(refresh_sensor, instance, None, policy)  # 8 steps since none: refresh
        assert isinstance(due, SensorResult) and due.run_requests[0].partition_key == \
            "step-000007"
        _launch(instance, due.run_requests[0])
        ingest(instance, *range(8, 12))
        assert isinstance(_tick(refresh_sensor, instance, due.cursor, policy), SkipReason)
        state["tau"] = 1.7  # fell 15%: back to every N
        late = _tick(refresh_sensor, instance, due.cursor, policy)
        assert late.run_requests[0].partition_key == "step-000011"
