"""``aerie demo`` end to end on a small demo world: trainer → snapshots → sensor → Dagster."""

from __future__ import annotations

import pytest
from dagster import AssetKey, DagsterInstance

from jobs import cli
from pipeline.demo.config import DemoConfig
from pipeline.evaluation.stage import read_report
from pipeline.snapshot.stage import completed_steps, read_accepted
from pipeline.storage import Storage


@pytest.fixture
def aerie_home(tmp_path, monkeypatch):
    for var in ("AERIE_STORAGE_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "DAGSTER_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.slow
def test_demo_world_flows_through_dagster(aerie_home):
    config = DemoConfig.small(num_steps=3)
    cli._prepare_dagster_home()
    world = cli.generate_demo_world(config=config)
    assert len(world["steps"]) == 3
    assert (aerie_home / "dagster" / "dagster.yaml").exists()  # all state in one directory

    storage = Storage((aerie_home / "storage").as_uri())
    assert completed_steps(storage) == [0, 1, 2]
    assert cli.run_pipeline() == ["step-000000", "step-000001", "step-000002"]

    instance = DagsterInstance.get()
    assert instance.get_materialized_partitions(AssetKey("rollout_snapshot")) == {
        "step-000000", "step-000001", "step-000002"}
    per_step = config.prompts_per_step * config.samples_per_prompt
    for step in range(3):
        table = read_accepted(storage, step)
        assert table.num_rows == per_step  # the demo trainer writes only valid records
        assert set(table.column("trainer_step").to_pylist()) == {step}

    assert cli.train_newest() == "step-000002"
    # the refresh's own partition: one per refresh, none for the steps in between
    assert instance.get_dynamic_partitions("refresh_steps") == ["step-000002"]
    for name in ("drafter_checkpoint", "acceptance_eval", "registered_drafter",
                 "serving_drafter"):
        assert instance.get_materialized_partitions(AssetKey(name)) == {"step-000002"}, name
    assert storage.exists("drafters/step=000002/_manifest.json")
    report = read_report(storage, 2)
    assert report.heldout["prompts"] > 0 and set(report.contestants) == {
        "candidate", "no_drafter"}  # the first refresh has no champion
    assert all(c.outputs_match_baseline == report.heldout["prompts"]
               for c in report.contestants.values())  # lossless on the demo policy
    decision = instance.get_latest_materialization_event(
        AssetKey("serving_drafter")).asset_materialization.metadata
    assert decision["action"].value in ("promoted", "refused")
    assert decision["reasons"].value  # a decision always says why
    assert (aerie_home / "mlflow" / "mlflow.db").exists()  # the registry lives in the home

    assert cli.run_pipeline() == []  # a second run finds nothing new
    assert cli.generate_demo_world(config=config) == world  # and reuses the world
