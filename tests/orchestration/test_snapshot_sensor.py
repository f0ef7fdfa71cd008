"""The snapshot sensor, stepped through cursor states with build_sensor_context."""

from __future__ import annotations

from dagster import SensorResult, SkipReason, build_sensor_context

from jobs.snapshots import snapshot_sensor
from pipeline.layout import raw_prefix

from .conftest import write_step


def tick(instance, resource, cursor):
    return snapshot_sensor(build_sensor_context(instance=instance, cursor=cursor,
                                                resources={"storage": resource}))


def test_sensor_discovers_each_completed_step_once(instance, local_storage, tmp_path):
    storage, resource = local_storage
    assert isinstance(tick(instance, resource, None), SkipReason)  # nothing yet

    write_step(storage, tmp_path, 0)
    write_step(storage, tmp_path, 1)
    first = tick(instance, resource, None)
    assert isinstance(first, SensorResult)
    assert [r.partition_key for r in first.run_requests] == ["step-000000", "step-000001"]
    assert [r.run_key for r in first.run_requests] == ["step-000000", "step-000001"]
    assert list(first.dynamic_partitions_requests[0].partition_keys) == [
        "step-000000", "step-000001"]
    assert first.cursor == "1"

    assert isinstance(tick(instance, resource, first.cursor), SkipReason)  # no repeats

    storage.write_bytes(f"{raw_prefix(3)}/part-00000.parquet", b"unfinished")  # no marker
    write_step(storage, tmp_path, 2)
    second = tick(instance, resource, first.cursor)
    assert [r.partition_key for r in second.run_requests] == ["step-000002"]
    assert second.cursor == "2"

    restarted = tick(instance, resource, None)  # a lost cursor re-requests; run keys dedupe
    assert [r.run_key for r in restarted.run_requests] == [
        "step-000000", "step-000001", "step-000002"]
