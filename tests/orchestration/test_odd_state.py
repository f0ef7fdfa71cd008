"""State the sensors did not make never stops them: partition keys typed in the UI or
written by a script, materializations and runs on them, and run tags Aerie did not write
are skipped and reported by every tick, while the steps Aerie made go on as before."""

from __future__ import annotations

import re

import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterRunStatus,
    SensorResult,
    SkipReason,
    build_sensor_context,
    instance_for_test,
)

from assets.groups import DATA_ASSETS
from assets.partitions import REFRESH_STEP_TAG, ingested_steps, parse_step, step_key
from jobs.refresh import drift_fired, refresh_sensor, requested_steps
from jobs.snapshots import ingest_runs, snapshot_sensor
from resources.storage import StorageResource
from tests.orchestration.conftest import ingest, refresh_job, trigger_resources

pytestmark = pytest.mark.integration

# keys no step_key() writes: other case, digits, widths, signs and spaces, other words
ODD = ["step-7", "Step-000001", "step-0000001", "foo", "step-00000x", "step-٠٠٠٠٠١",
       "step--00001", "step-000001 ", "step-+00001", "step-", "1"]
CANONICAL = re.compile(r"step-(\d{6}|[1-9]\d{6,})", re.ASCII)


def test_the_odd_keys_are_exactly_the_keys_step_key_does_not_write():
    assert all(CANONICAL.fullmatch(k) is None and parse_step(k) is None for k in ODD)
    for step in (0, 7, 999_999, 1_000_000, 123_456_789):
        assert parse_step(step_key(step)) == step and CANONICAL.fullmatch(step_key(step))


def _odd_world(instance) -> None:
    """Steps 0..3 ingested as Aerie does; every odd key added, materialized and run on,
    and refresh runs tagged with steps Aerie never writes."""
    instance.add_dynamic_partitions("rl_steps", [step_key(s) for s in range(4)] + ODD)
    instance.add_dynamic_partitions("refresh_steps", ODD)
    ingest(instance, 0, 1, 2, 3)
    for key in ODD:
        for name in DATA_ASSETS:
            instance.report_runless_asset_event(AssetMaterialization(
                asset_key=AssetKey(name), partition=key))
    from definitions import defs

    ingest_job = defs.resolve_job_def("ingest_step")
    for key in ODD:
        instance.create_run_for_job(ingest_job, tags={"dagster/partition": key},
                                    status=DagsterRunStatus.FAILURE)
        instance.create_run_for_job(refresh_job(), status=DagsterRunStatus.FAILURE, tags={
            "dagster/partition": key, REFRESH_STEP_TAG: f"{key}?",  # no step number
            "aerie/trigger": "drift", "aerie/drifted_version": "1"})


def test_every_tick_skips_and_reports_what_aerie_did_not_make(tmp_path):
    with instance_for_test() as instance:
        _odd_world(instance)
        assert ingested_steps(instance) == [0, 1, 2, 3]  # the odd keys are no RL steps
        assert set(ingest_runs(instance)) == set()
        assert requested_steps(instance) == set() and drift_fired(instance) == {}

        storage = StorageResource(url=(tmp_path / "store").as_uri())
        result = snapshot_sensor(build_sensor_context(instance=instance, cursor=None,
                                                      resources={"storage": storage}))
        assert isinstance(result, SensorResult) and result.skip_reason is not None
        assert f"skipped {len(ODD)} partition keys not of the form step-NNNNNN" in \
            result.skip_reason.skip_message

        refresh = refresh_sensor(build_sensor_context(
            instance=instance, cursor=None, resources=trigger_resources()))
        assert isinstance(refresh, SensorResult)  # the block of steps 0..3 is due
        (request,) = refresh.run_requests
        assert request.partition_key == step_key(3)


def test_a_refresh_tick_with_nothing_due_names_the_odd_keys():
    with instance_for_test() as instance:
        _odd_world(instance)
        skip = refresh_sensor(build_sensor_context(
            instance=instance, cursor='{"last": 3}', resources=trigger_resources()))
        assert isinstance(skip, SkipReason)
        assert "partition keys not of the form step-NNNNNN" in skip.skip_message
        assert "'Step-000001'" in skip.skip_message
