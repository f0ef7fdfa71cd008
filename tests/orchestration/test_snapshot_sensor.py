"""The snapshot sensor, ticked with build_sensor_context on a temporary instance: every
completed step is requested until it is ingested or being ingested, whatever the order in
which steps complete and whatever became of the cursor."""

from __future__ import annotations

import json
import logging

import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterRunStatus,
    SensorResult,
    build_sensor_context,
)

from assets.groups import DATA_ASSETS
from jobs.snapshots import SEEN_STEPS, plan_ingest, plan_rewrites, snapshot_sensor
from pipeline.capture.shards import SHARDS_KIND, shard_name
from pipeline.contracts import MANIFEST_NAME, Manifest
from pipeline.layout import odd_entries, raw_prefix, shards_prefix
from pipeline.manifest import write_manifest
from pipeline.storage import Storage
from tests.orchestration.conftest import on_every_dagster_backend

from .conftest import write_step

pytestmark = pytest.mark.integration


def tick(instance, resource, cursor) -> SensorResult:
    result = snapshot_sensor(build_sensor_context(instance=instance, cursor=cursor,
                                                  resources={"storage": resource}))
    assert isinstance(result, SensorResult)
    return result


def requested(result: SensorResult) -> list[str]:
    return [r.partition_key for r in result.run_requests]


def complete(storage: Storage, *steps: int) -> None:
    """The completion marker of each step (all the sensor looks at: one listing)."""
    for s in steps:
        storage.write_bytes(f"{raw_prefix(s)}/{MANIFEST_NAME}", b"{}")


def launch(instance, result: SensorResult, status=DagsterRunStatus.NOT_STARTED) -> None:
    """What the daemon does with a tick: add the partitions, create one run per request."""
    from definitions import defs

    job = defs.resolve_job_def("ingest_step")
    for add in result.dynamic_partitions_requests:
        instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
    for request in result.run_requests:
        instance.create_run_for_job(job_def=job, run_id=None, status=status,
                                    tags={"dagster/partition": request.partition_key,
                                          "dagster/run_key": request.run_key})


@on_every_dagster_backend
def test_sensor_discovers_each_completed_step_once(instance, local_storage, tmp_path):
    storage, resource = local_storage
    assert tick(instance, resource, None).skip_reason is not None  # nothing yet

    write_step(storage, tmp_path, 0)
    write_step(storage, tmp_path, 1)
    first = tick(instance, resource, None)
    assert requested(first) == ["step-000000", "step-000001"]
    assert [r.run_key for r in first.run_requests] == ["step-000000", "step-000001"]
    (add,) = first.dynamic_partitions_requests
    assert add.partitions_def_name == "rl_steps"
    assert list(add.partition_keys) == ["step-000000", "step-000001"]
    # before the daemon created the runs, the cursor keeps them from being requested again
    assert tick(instance, resource, first.cursor).skip_reason is not None
    launch(instance, first)
    again = tick(instance, resource, first.cursor)
    assert again.skip_reason is not None and json.loads(again.cursor)["pending"] == []

    storage.write_bytes(f"{raw_prefix(3)}/part-00000.parquet", b"unfinished")  # no marker
    write_step(storage, tmp_path, 2)
    assert requested(tick(instance, resource, again.cursor)) == ["step-000002"]


def test_a_step_completing_after_a_later_one_is_requested(instance, local_storage):
    storage, resource = local_storage
    complete(storage, 0, 1, 3)  # step 2's snapshot is still being written
    first = tick(instance, resource, None)
    assert requested(first) == ["step-000000", "step-000001", "step-000003"]
    launch(instance, first, DagsterRunStatus.SUCCESS)
    assert tick(instance, resource, first.cursor).skip_reason is not None
    complete(storage, 2)
    late = tick(instance, resource, first.cursor)
    assert requested(late) == ["step-000002"]
    assert list(late.dynamic_partitions_requests[0].partition_keys) == ["step-000002"]


def test_a_lost_cursor_requests_nothing_twice_and_loses_nothing(instance, local_storage):
    storage, resource = local_storage
    complete(storage, 0, 1, 2, 3)
    first = tick(instance, resource, None)
    launch(instance, first)  # the daemon created all four runs; then the cursor is lost
    complete(storage, 5)
    assert requested(tick(instance, resource, None)) == ["step-000005"]
    for name in DATA_ASSETS:  # step 4 ingested another way (a UI backfill): not requested
        instance.report_runless_asset_event(AssetMaterialization(name, partition="step-000004"))
    complete(storage, 4)
    assert requested(tick(instance, resource, None)) == ["step-000005"]
    # a failed ingest is not an ingested step: it stays requested (the daemon dedupes the
    # run key; `aerie demo` retries it)
    (run,) = [r for r in instance.get_runs() if r.tags["dagster/partition"] == "step-000001"]
    instance.report_run_failed(run)
    assert requested(tick(instance, resource, None)) == ["step-000001", "step-000005"]


def test_each_tick_lists_the_snapshot_root_once(instance, local_storage, monkeypatch):
    """Per-tick cost does not grow with the number of steps: one listing of the snapshot
    root and one of the shards root, no per-step reads."""
    storage, resource = local_storage
    complete(storage, *range(40))
    for s in range(30):
        for name in DATA_ASSETS:
            instance.report_runless_asset_event(
                AssetMaterialization(AssetKey(name), partition=f"step-{s:06d}"))
    calls: dict[str, int] = {}
    for method in ("list", "list_versions", "list_dirs", "exists", "read_bytes", "open_read"):
        original = getattr(Storage, method)

        def counted(self, *args, _name=method, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Storage, method, counted)
    result = tick(instance, resource, None)
    assert requested(result) == [f"step-{s:06d}" for s in range(30, 40)]
    assert calls == {"list_versions": 1, "list": 1}


def test_a_step_whose_shards_are_committed_is_ingested_whatever_dagster_remembers(
        instance, local_storage):
    """Another Dagster instance over the same storage, or a step whose run history retention
    pruned: its committed shards (retention-deleted ones too) say it is ingested, so its
    deleted shards are never extracted again; a step under rewrite (manifest withdrawn) or
    never extracted is requested."""
    storage, resource = local_storage
    complete(storage, 0, 1, 2, 3)
    for s, meta in ((0, {"deleted": {"at": "then", "by_refresh": 9}}), (1, {})):
        write_manifest(storage, shards_prefix(s), Manifest(SHARDS_KIND, 1, (), meta))
    storage.write_bytes(f"{shards_prefix(2)}/{shard_name(0)}", b"unfinished")  # no manifest
    assert requested(tick(instance, resource, None)) == ["step-000002", "step-000003"]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def logged_tick(instance, resource, cursor) -> tuple[SensorResult, list[logging.LogRecord]]:
    """A tick, with what the sensor logged through ``context.log``."""
    context = build_sensor_context(instance=instance, cursor=cursor,
                                   resources={"storage": resource})
    handler = _Records()
    context.log.addHandler(handler)
    result = snapshot_sensor(context)
    assert isinstance(result, SensorResult)
    return result, [r for r in handler.records if r.levelno >= logging.WARNING]


def test_odd_step_directories_are_skipped_named_and_never_fail_a_tick(instance,
                                                                      local_storage):
    """Only ``step=NNNNNN`` is a step: ``step=0003`` is not step 3 a second time, ``step=²``
    (a digit to str.isdigit, not to int) and ``step=abc`` are no steps at all."""
    storage, resource = local_storage
    odd = ["step=²", "step=0003", "step=abc", "step=٣"]  # ٣: Arabic-Indic 3, int() reads it
    for name in [*odd, "step=000003"]:
        storage.write_bytes(f"rollouts/{name}/{MANIFEST_NAME}", b"{}")
    storage.write_bytes("rollouts/step=0003/part-00000.parquet", b"rows")

    first, warnings = logged_tick(instance, resource, None)
    assert requested(first) == ["step-000003"]  # once, from step=000003 only
    assert list(first.dynamic_partitions_requests[0].partition_keys) == ["step-000003"]
    (warning,) = warnings
    text = warning.getMessage()
    assert "skipped 4 entries under rollouts/ that are not step directories" in text
    assert all(repr(name) in text for name in odd)
    assert "'step=000003'" not in text

    launch(instance, first)
    again, warnings = logged_tick(instance, resource, first.cursor)
    assert again.run_requests == [] and len(warnings) == 1  # reported on every tick
    assert "skipped 4 entries" in again.skip_reason.skip_message


def test_the_report_of_odd_entries_names_only_a_few(instance, local_storage):
    storage, resource = local_storage
    for i in range(8):
        storage.write_bytes(f"rollouts/step={i:04d}/{MANIFEST_NAME}", b"{}")
    storage.write_bytes("rollouts/notes.txt", b"a stray file")
    result, (warning,) = logged_tick(instance, resource, None)
    assert result.run_requests == []
    text = warning.getMessage()
    assert "skipped 9 entries" in text and text.endswith("and 4 more")
    assert text.count("'") == 2 * 5  # five names shown
    assert odd_entries(storage.list("rollouts"), "rollouts") == [
        "notes.txt", *[f"step={i:04d}" for i in range(8)]]


def test_plan_ingest():
    failed, ok = DagsterRunStatus.FAILURE, DagsterRunStatus.SUCCESS
    assert plan_ingest([0, 1, 2, 3], {0: ok, 1: failed}, [2], []) == ([1, 3], [1, 3])
    assert plan_ingest([0, 1, 2, 3], {0: ok, 1: failed}, [2], [3]) == ([1], [1, 3])
    assert plan_ingest([3, 0], {3: DagsterRunStatus.STARTED}, [], [0]) == ([], [0])
    assert plan_ingest([], {}, [], [7]) == ([], [7])  # requested, its run not created yet


def test_a_rewritten_step_is_ingested_again_once_its_ingest_finished(instance, local_storage,
                                                                    tmp_path):
    """A trainer restarted from a checkpoint writes step 1 again (other rollouts): its
    snapshot, tokens and shards must follow, so the step is requested again, once."""
    storage, resource = local_storage
    write_step(storage, tmp_path, 0)
    write_step(storage, tmp_path, 1)
    first = tick(instance, resource, None)
    launch(instance, first, DagsterRunStatus.STARTED)
    write_step(storage, tmp_path, 1, n_good=5)  # rewritten while its first ingest runs
    running = tick(instance, resource, first.cursor)
    assert running.run_requests == []  # never two ingests of one step at once
    for run in instance.get_runs():  # the first ingests finish
        instance.delete_run(run.run_id)
    launch(instance, first, DagsterRunStatus.SUCCESS)
    again = tick(instance, resource, running.cursor)
    assert requested(again) == ["step-000001"]
    (request,) = again.run_requests
    assert request.run_key.startswith("step-000001@")  # a new run key: the daemon runs it
    launch(instance, again, DagsterRunStatus.SUCCESS)
    quiet = tick(instance, resource, again.cursor)
    assert quiet.run_requests == []  # once
    write_step(storage, tmp_path, 1, n_good=6)  # and again: another version, another run
    third = tick(instance, resource, quiet.cursor)
    assert requested(third) == ["step-000001"]
    assert third.run_requests[0].run_key not in (request.run_key, "step-000001")
    assert tick(instance, resource, None).run_requests == []  # a lost cursor: none twice


def test_plan_rewrites():
    ok, running = DagsterRunStatus.SUCCESS, DagsterRunStatus.STARTED
    # first sight: remembered only; a changed marker whose ingest finished: requested
    assert plan_rewrites({0: "a", 1: "b"}, {}, {}, []) == ([], {0: "a", 1: "b"})
    assert plan_rewrites({0: "a", 1: "c"}, {0: "a", 1: "b"}, {0: ok, 1: ok}, []) == (
        [1], {0: "a", 1: "c"})
    # its ingest is running, or requested and not yet run: the old version is kept
    assert plan_rewrites({1: "c"}, {1: "b"}, {1: running}, []) == ([], {1: "b"})
    assert plan_rewrites({1: "c"}, {1: "b"}, {1: ok}, [1]) == ([], {1: "b"})
    # only the newest SEEN_STEPS steps are remembered
    many = {s: "v" for s in range(SEEN_STEPS + 5)}
    assert sorted(plan_rewrites(many, {}, {}, [])[1]) == list(range(5, SEEN_STEPS + 5))
