"""Every change of champion is a ``serving_drafter`` event, and every promotion path runs in
the pool ``promotion`` (limit 1 on the embedded instance): the manual override and the
rollback jobs executed on a temporary instance written by ``aerie``'s instance yaml, against
an embedded MLflow registry and a storage root under tmp."""

from __future__ import annotations

import dataclasses
import queue
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from dagster import AssetCheckKey, AssetKey, DagsterEventType, DagsterInstance

from aerie import cli
from jobs.release import promote_drafter_manually, rollback_drafter
from pipeline.layout import drafter_prefix
from pipeline.manifest import read_manifest, write_manifest
from pipeline.serving_now import read_serving
from pipeline.storage import Storage
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.serving import ServingResource
from resources.storage import StorageResource
from tests.conftest import ver
from tests.orchestration.conftest import on_every_dagster_backend, use_backend
from tests.release.helpers import lineage, make_drafter_dir, publish_drafter

pytestmark = pytest.mark.integration

STEPS = (10, 20, 30)  # the refresh steps of versions 1, 2, 3


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    return [make_drafter_dir(root / f"d{i}", seed=i) for i in range(len(STEPS))]


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


@pytest.fixture
def world(request, tmp_path, monkeypatch, drafter_dirs, tracking, dagster_backend):
    """The embedded default's instance (its dagster.yaml, on each storage backend), a storage
    root and a registry with versions 1-3 registered (not promoted): on PostgreSQL, MLflow
    and the promotion lease are there too."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    use_backend(cli.prepare_dagster_home(), dagster_backend)
    storage = Storage((tmp_path / "storage").as_uri())
    if dagster_backend is not None:  # MLflow on the same PostgreSQL server, as deployed
        tracking = request.getfixturevalue("postgres").new_database("mlflow"), tracking[1]
    mlflow = MlflowResource(tracking_uri=tracking[0], artifact_location=tracking[1],
                            target_family=f"t{uuid.uuid4().hex[:10]}",
                            lock_dir=str(tmp_path / "locks"), lock_timeout_s=120)
    registry = mlflow.build()
    for step, local in zip(STEPS, drafter_dirs, strict=True):
        uri = publish_drafter(storage, step, local)
        manifest = read_manifest(storage, drafter_prefix(step))  # as training writes it
        write_manifest(storage, drafter_prefix(step), dataclasses.replace(
            manifest, meta={**manifest.meta, "window_steps": [step - 1, step]}))
        registry.register(None, uri, lineage(manifest.meta["fingerprint"], uri, step=step))
    resources = {"storage": StorageResource(url=storage.root_url), "mlflow": mlflow,
                 "serving": ServingResource(), "refresh": RefreshPolicyResource()}
    with DagsterInstance.get() as instance:
        yield instance, storage, registry, resources


def force(instance, resources, version: str, run_id: str | None = None):
    return promote_drafter_manually.execute_in_process(
        instance=instance, resources=resources, run_id=run_id,
        run_config={"ops": {"force_promote_op": {"config": {
            "version": version, "actor": "alice", "reason": f"ship v{version}"}}}})


def roll_back(instance, resources, run_id: str | None = None):
    return rollback_drafter.execute_in_process(
        instance=instance, resources=resources, run_id=run_id,
        run_config={"ops": {"rollback_op": {"config": {"actor": "oncall-bob",
                                                       "reason": "τ regression"}}}})


def latest_serving_drafter(instance) -> tuple[str, dict]:
    """What the UI shows as the newest ``serving_drafter`` materialization."""
    event = instance.get_latest_materialization_event(AssetKey("serving_drafter"))
    m = event.asset_materialization
    return m.partition, {k: v.value for k, v in m.metadata.items()}


def test_every_change_of_champion_is_a_serving_drafter_event(world):
    instance, storage, registry, resources = world
    force(instance, resources, "1")
    force(instance, resources, "2")
    partition, meta = latest_serving_drafter(instance)
    assert partition == "step-000020" and ver(meta["champion"]) == "2"
    assert (meta["action"], meta["actor"], meta["reason"]) == ("forced", "alice", "ship v2")

    result = roll_back(instance, resources)
    partition, meta = latest_serving_drafter(instance)
    assert partition == "step-000010"  # the refresh that trained the restored champion
    assert ver(meta["champion"]) == "1" and ver(meta["previous_champion"]) == "2"
    assert (meta["action"], meta["promoted"]) == ("rolled_back", True)
    assert (meta["actor"], meta["reason"]) == ("oncall-bob", "τ regression")
    assert "rollback v2 -> 1" in meta["reasons"]
    assert registry.champion().version == "1"  # the event tells the truth
    assert read_serving(storage, registry.model_name).target.drafter_uri == storage.url(
        drafter_prefix(10))
    (event,) = instance.get_records_for_run(
        result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    assert event.event_log_entry.dagster_event.asset_key == AssetKey("serving_drafter")
    assert set(instance.get_dynamic_partitions("refresh_steps")) == {"step-000010",
                                                                    "step-000020"}
    (check,) = instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey("serving_drafter"), "serving_staleness"), limit=1)
    assert check.run_id == result.run_id  # the staleness check judges the restored champion
    assert check.evaluation.passed and check.evaluation.metadata["version"].value == "1"
    assert check.evaluation.metadata["window_end"].value == 10

    roll_back(instance, resources)  # v1 had no champion before it: serve no drafter
    partition, meta = latest_serving_drafter(instance)
    assert (partition, ver(meta["champion"]), ver(meta["previous_champion"])) == (
        "step-000010", "none", "1")
    assert registry.champion() is None


def test_the_jobs_promotion_paths_are_in_the_pool_and_ingestion_is_not():
    """Ingestion never queues behind a promotion: ``serving_acceptance`` (in ``ingest_step``)
    is outside the pool; its rare rollback takes the promotion lock instead."""
    from definitions import defs

    repo = defs.get_repository_def()
    pooled = {node.name for job in repo.get_all_jobs() for node in job.graph.node_defs
              if getattr(node, "pool", None) == "promotion"}
    assert pooled == {"serving_drafter", "force_promote_op", "rollback_op"}
    ingest = repo.get_job("ingest_step")
    assert {n.pool for n in ingest.graph.node_defs} == {None}
    for job in (promote_drafter_manually, rollback_drafter):
        assert {n.pool for n in job.graph.node_defs} == {"promotion"}, job.name


def test_the_embedded_instance_limits_the_promotion_pool_to_one(world):
    instance, _, _, resources = world
    assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
    force(instance, resources, "1")  # the pool is created at its first use, with the limit
    assert instance.event_log_storage.get_concurrency_info("promotion").slot_count == 1


@on_every_dagster_backend
def test_two_promotion_runs_are_serialised_by_the_pool(world, monkeypatch):
    """Run A (override to v3) takes the pool's only slot and then waits inside its op (the
    test holds the registry's promotion lock); run B (rollback) starts meanwhile and is held
    back before its op starts. Released, A finishes first and B rolls back A's change."""
    from dagster._core.execution.plan.instance_concurrency_context import (
        InstanceConcurrencyContext,
    )

    instance, storage, registry, resources = world
    force(instance, resources, "1")
    force(instance, resources, "2")
    claims: queue.Queue = queue.Queue()
    original = InstanceConcurrencyContext.claim

    def claim(self, key, step_key, step_priority=0):
        granted = original(self, key, step_key, step_priority)
        claims.put((self._run_id, key, granted))
        return granted

    monkeypatch.setattr(InstanceConcurrencyContext, "claim", claim)
    run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
    lock = registry.promotion_lock()  # what A waits for: the file lock, or the lease
    with ThreadPoolExecutor(max_workers=2) as pool, lock:
        a = pool.submit(force, instance, resources, "3", run_a)
        assert claims.get(timeout=120) == (run_a, "promotion", True)
        b = pool.submit(roll_back, instance, resources, run_b)
        assert claims.get(timeout=120) == (run_b, "promotion", False)
        started = instance.get_records_for_run(run_b, of_type=DagsterEventType.STEP_START)
        assert not started.records  # B waits for the slot, not inside its op
        assert not a.done() and registry.champion().version == "2"
        lock.release()  # A goes on, frees the slot; B follows
        assert a.result(timeout=120).success and b.result(timeout=120).success
    assert registry.champion().version == "2"  # v3 (A), then rolled back to v2 (B)
    partition, meta = latest_serving_drafter(instance)
    assert (partition, ver(meta["champion"]), ver(meta["previous_champion"])) == (
        "step-000020", "2", "3")


def test_an_older_embedded_instance_gets_the_missing_limits(tmp_path, monkeypatch):
    """An instance written before the pool existed gains the limits; its own values stay."""
    import yaml

    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\nconcurrency:\n  runs:\n    max_concurrent_runs: 3\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    cli.prepare_dagster_home()
    config = yaml.safe_load((home / "dagster.yaml").read_text())
    assert config["concurrency"]["pools"] == {"default_limit": 1}
    assert config["concurrency"]["runs"]["max_concurrent_runs"] == 3
    assert config["concurrency"]["runs"]["tag_concurrency_limits"][0]["key"] == "aerie/serial"
    with DagsterInstance.get() as instance:  # Dagster accepts the merged file
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
