"""The refresh triggers, stepped through ticks: one refresh per block of N ingested steps."""

from __future__ import annotations

import json

import pytest
from dagster import (
    DagsterRunStatus,
    SensorResult,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
    instance_for_test,
)

from assets.groups import DATA_ASSETS
from assets.partitions import step_key
from jobs.refresh import (
    drafter_refresh_schedule,
    due_refresh,
    refresh_request,
    refresh_sensor,
)
from resources.refresh import RefreshPolicyResource
from tests.orchestration.conftest import (
    ingest,
    on_every_dagster_backend,
    refresh_job,
    trigger_resources,
)

pytestmark = pytest.mark.integration



@pytest.mark.parametrize(("ingested", "last", "every", "due"), [
    ([], -1, 4, None),
    ([0, 1, 2], -1, 4, None),
    ([0, 1, 2, 3], -1, 4, 3),
    ([0, 1, 2, 3, 4, 5], -1, 4, 5),  # ingestion ran ahead: refresh the newest
    ([0, 1, 2, 3, 4, 5, 6], 3, 4, None),
    (list(range(8)), 3, 4, 7),
    (list(range(8)), 7, 4, None),
    (list(range(9)), 5, 4, 8),  # after a late refresh, the next block boundary counts
    ([0], -1, 1, 0),
])
def test_due_refresh(ingested, last, every, due):
    assert due_refresh(ingested, last, every) == due


def test_every_block_is_refreshed_once_whatever_order_its_steps_finish_in():
    """Steps finish ingesting in any order: each tick asks for a refresh only when its whole
    window is in, and over a run every block boundary is passed by exactly one refresh."""
    import random

    rng = random.Random(0)
    for case in range(300):
        every, window, total = rng.randint(1, 5), rng.randint(1, 6), rng.randint(1, 30)
        order = list(range(total))
        for i in range(total):  # each step finishes up to 3 places out of order
            j = min(total - 1, i + rng.randint(0, 3))
            order[i], order[j] = order[j], order[i]
        ingested, last, refreshes = [], -1, []
        for step in order:
            ingested.append(step)
            due = due_refresh(sorted(ingested), last, every, window)
            if due is not None:
                window_steps = range(max(0, due - window + 1), due + 1)
                assert all(s in ingested for s in window_steps), (case, due, ingested)
                refreshes.append(due)
                last = due
        blocks = [(s + 1) // every for s in refreshes]
        assert blocks == sorted(set(blocks)), case  # never twice for one block
        if total >= every:  # once everything is in, the newest block has its refresh
            assert refreshes and (refreshes[-1] + 1) // every == total // every, case


def test_a_boundary_step_ingested_late_holds_the_refresh_back():
    assert due_refresh([0, 1, 2, 4], -1, 4, window=4) is None  # step 3 is not in yet
    assert due_refresh([0, 1, 2, 3, 4], -1, 4, window=4) == 4
    assert due_refresh([0, 1, 2, 4, 5, 6, 7, 8], -1, 4, window=2) == 8  # 7..8 complete


def tick(instance, cursor, policy=None):
    return refresh_sensor(build_sensor_context(
        instance=instance, cursor=cursor, resources=trigger_resources(policy)))


def test_sensor_requests_exactly_one_refresh_per_block(dagster_backend):
    with instance_for_test(overrides=dagster_backend) as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(12)])
        ingest(instance, 0, 1, 2)
        assert isinstance(tick(instance, None), SkipReason)
        ingest(instance, 3, assets=DATA_ASSETS[:2])  # shards not done yet: not ingested
        assert isinstance(tick(instance, None), SkipReason)
        ingest(instance, 3)
        first = tick(instance, None)
        assert isinstance(first, SensorResult)
        (req,) = first.run_requests
        assert req.partition_key == "step-000003"
        assert req.run_key == "drafter-refresh-step-000003"
        assert req.run_config["ops"]["vocab_mapping"]["config"]["window"] == 4
        (add,) = first.dynamic_partitions_requests  # the refresh's own partition, only it
        assert (add.partitions_def_name, list(add.partition_keys)) == (
            "refresh_steps", ["step-000003"])
        assert json.loads(first.cursor) == {"last": 3}
        assert isinstance(tick(instance, first.cursor), SkipReason)  # same tick: nothing new
        ingest(instance, 4, 5, 6)
        assert isinstance(tick(instance, first.cursor), SkipReason)
        ingest(instance, 7)
        second = tick(instance, first.cursor)
        assert [r.run_key for r in second.run_requests] == ["drafter-refresh-step-000007"]
        # A lost cursor counts blocks from the newest step a refresh run was launched for.
        launched(instance, 3)
        assert tick(instance, None).run_requests[0].run_key == "drafter-refresh-step-000007"
        launched(instance, 7)
        ingest(instance, 8, 9)
        assert isinstance(tick(instance, None), SkipReason)  # not a new block: 9 is not due
        ingest(instance, 10, 11)
        assert tick(instance, None).run_requests[0].partition_key == "step-000011"


def launched(instance, step: int, status=DagsterRunStatus.SUCCESS) -> None:
    """A finished refresh run of ``step``, tagged as the triggers tag theirs."""
    instance.create_run_for_job(job_def=refresh_job(), run_id=None, tags=refresh_request(step).tags,
                                status=status)


def test_every_and_window_come_from_the_refresh_policy(dagster_backend):
    policy = RefreshPolicyResource(every=2, window=3)
    with instance_for_test(overrides=dagster_backend) as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(6)])
        ingest(instance, 0)
        assert isinstance(tick(instance, None, policy), SkipReason)
        ingest(instance, 1)
        first = tick(instance, None, policy)
        (req,) = first.run_requests
        assert req.partition_key == "step-000001"
        assert req.run_config["ops"]["vocab_mapping"]["config"]["window"] == 3
        ingest(instance, 2, 3)
        assert tick(instance, first.cursor, policy).run_requests[0].partition_key == \
            "step-000003"


def test_policy_reads_the_environment(monkeypatch):
    from resources.env import EnvConfigError
    from resources.refresh import refresh_policy_from_env

    monkeypatch.setenv("AERIE_REFRESH_EVERY", "8")
    monkeypatch.setenv("AERIE_REFRESH_WINDOW", "2")
    monkeypatch.setenv("AERIE_STALE_AFTER_STEPS", "20")
    monkeypatch.setenv("AERIE_MAX_TAU_DROP_PERCENT", "5")
    resolved = refresh_policy_from_env().process_config_and_initialize()
    assert (resolved.every, resolved.window) == (8, 2)
    assert (resolved.stale_after_steps, resolved.max_tau_drop_percent) == (20, 5)
    for var in ("AERIE_REFRESH_WINDOW", "AERIE_STALE_AFTER_STEPS",
                "AERIE_MAX_TAU_DROP_PERCENT"):
        monkeypatch.delenv(var)
    defaults = refresh_policy_from_env().process_config_and_initialize()
    assert (defaults.window, defaults.stale_after_steps, defaults.max_tau_drop_percent) == (
        4, 8, 10)
    monkeypatch.setenv("AERIE_REFRESH_EVERY", "0")  # refused when the definitions load
    with pytest.raises(EnvConfigError, match=r"AERIE_REFRESH_EVERY \(RefreshPolicyResource"
                                             r"\.every\): Input should be greater than or "
                                             r"equal to 1"):
        refresh_policy_from_env()


@on_every_dagster_backend
def test_sensor_waits_while_a_refresh_is_in_flight(dagster_backend):
    from dagster import DagsterRun

    with instance_for_test(overrides=dagster_backend) as instance:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(4)])
        ingest(instance, 0, 1, 2, 3)
        run = instance.create_run_for_job(
            job_def=refresh_job(), run_id=None, status=DagsterRunStatus.STARTED)
        assert isinstance(run, DagsterRun)
        result = tick(instance, None)
        assert isinstance(result, SkipReason) and "still queued or running" in str(result)
        instance.report_run_failed(run)
        assert isinstance(tick(instance, None), SensorResult)


def test_schedule_refreshes_the_newest_step_once(dagster_backend):
    with instance_for_test(overrides=dagster_backend) as instance, \
            build_schedule_context(  # `with`: it is exited
            instance=instance, resources=trigger_resources()) as ctx:
        instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(4)])
        assert isinstance(drafter_refresh_schedule(ctx), SkipReason)
        ingest(instance, 0, 1, 2, 3)
        assert instance.get_dynamic_partitions("refresh_steps") == []
        req = drafter_refresh_schedule(ctx)
        assert req.run_key == "drafter-refresh-step-000003"  # same scheme as the sensor
        # a schedule cannot return partition requests: it added the refresh partition itself
        assert instance.get_dynamic_partitions("refresh_steps") == ["step-000003"]
        launched(instance, 3, DagsterRunStatus.FAILURE)
        skip = drafter_refresh_schedule(ctx)  # launched, even though it failed: not again
        assert isinstance(skip, SkipReason) and "already launched" in str(skip)
        assert isinstance(tick(instance, None), SkipReason)  # nor by the sensor (block 0..3)


@on_every_dagster_backend
def test_dagster_resolves_the_triggers_requests_in_the_refresh_partitions(dagster_backend):
    """Dagster's own tick evaluation (what the daemon runs) validates each request's partition
    key against ``refresh_steps``: the sensor's request resolves because its result adds the
    key, the schedule's because it added the key to the instance."""
    from definitions import defs

    repo = defs.get_repository_def()
    with instance_for_test(overrides=dagster_backend) as instance:
        ingest(instance, 0, 1, 2, 3)
        sensor_ctx = build_sensor_context(instance=instance, instance_ref=instance.get_ref(),
                                          repository_def=repo,
                                          resources=trigger_resources())
        data = refresh_sensor.evaluate_tick(sensor_ctx)
        (req,) = data.run_requests
        assert req.tags["dagster/partition"] == "step-000003"
        assert instance.get_dynamic_partitions("refresh_steps") == []  # the daemon adds it
        with build_schedule_context(instance=instance, repository_def=repo,
                                    resources=trigger_resources()) as schedule_ctx:
            (req,) = drafter_refresh_schedule.evaluate_tick(schedule_ctx).run_requests
        assert req.tags["dagster/partition"] == "step-000003"
        assert instance.get_dynamic_partitions("refresh_steps") == ["step-000003"]
