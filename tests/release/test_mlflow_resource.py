"""The MLflow resource: embedded default under AERIE_HOME (and movable with it), env-only
secrets, telemetry off."""

from __future__ import annotations

import os
import shutil
import sqlite3
import uuid
from pathlib import Path

import pytest

from pipeline.release.mlflow_relocate import follow_moved_artifacts
from resources.mlflow import MlflowResource, mlflow_from_env
from tests.release.helpers import lineage, make_drafter_dir

pytestmark = pytest.mark.integration


def test_embedded_default_lives_under_aerie_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    registry = MlflowResource(target_family="Demo").build()
    home = tmp_path / "home" / "mlflow"
    assert registry.client.tracking_uri == f"sqlite:///{home / 'mlflow.db'}"
    assert registry.model_name == "aerie-drafter-demo"
    assert registry.lock_path == home / "promotion-aerie-drafter-demo.lock"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    reg = registry.publish(drafter_dir=make_drafter_dir(tmp_path / "d"),
                           lineage=lineage(uuid.uuid4().hex, "file:///s/drafters/x"))
    assert reg.version.source.startswith((home / "artifacts").as_uri())
    assert (home / "mlflow.db").is_file() and not (tmp_path / "mlruns").exists()


def test_configuration_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    monkeypatch.setenv("AERIE_TARGET_FAMILY", "llama3")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cr3t")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    resource = mlflow_from_env()
    resolved = resource.process_config_and_initialize()
    assert resolved.tracking_uri == "http://mlflow.internal:5000"
    assert resolved.target_family == "llama3" and resolved.registry_uri is None
    assert resolved.resolved_artifact_location() is None  # the server decides
    assert "s3cr3t" not in repr(resource) and "s3cr3t" not in repr(resolved)
    assert not any("token" in f.lower() or "password" in f.lower()
                   for f in MlflowResource.model_fields)


def _publish_in(home, tmp_path, monkeypatch, seed: int):
    monkeypatch.setenv("AERIE_HOME", str(home))
    registry = MlflowResource(target_family="demo").build()
    return registry, registry.publish(
        drafter_dir=make_drafter_dir(tmp_path / f"d{seed}", seed=seed),
        lineage=lineage(uuid.uuid4().hex, f"drafters/step={seed:06d}"))


def test_a_moved_embedded_store_follows_its_artifacts(tmp_path, monkeypatch):
    """Copy, then rename, an embedded store: every artifact location it recorded (the
    experiment's, the runs', the versions' sources) names the new place, the old place is
    never written again, and the files download from there."""
    old = tmp_path / "old"
    _, first = _publish_in(old, tmp_path, monkeypatch, seed=1)
    shutil.copytree(old, tmp_path / "copied")
    (tmp_path / "copied").rename(tmp_path / "new")
    shutil.rmtree(old)
    registry, second = _publish_in(tmp_path / "new", tmp_path, monkeypatch, seed=2)
    artifacts = (tmp_path / "new" / "mlflow" / "artifacts").as_uri()
    for version in (registry.get_version(first.version.version), second.version):
        assert version.source.startswith(artifacts + "/aerie-drafter-demo/"), version.source
    experiment = registry.client.get_experiment_by_name("aerie-drafter-demo")
    assert experiment.artifact_location == artifacts + "/aerie-drafter-demo"
    assert registry.client.get_run(first.run_id).info.artifact_uri.startswith(artifacts)
    local = registry.client.download_artifacts(first.run_id, "drafter", str(tmp_path / "dl"))
    assert (Path(local) / "config.json").is_file()
    assert not old.exists()  # nothing wrote to the place the store left
    assert registry.runs.follow_moved_store() == 0  # nothing left to rewrite


def test_a_changed_artifact_root_leaves_existing_artifacts_where_they_are(tmp_path,
                                                                          monkeypatch):
    """Configuring another root (the artifacts did not come along) rewrites nothing: the
    experiment keeps its location, as MLflow itself would."""
    home = tmp_path / "home"
    _, first = _publish_in(home, tmp_path, monkeypatch, seed=1)
    elsewhere = (tmp_path / "elsewhere").as_uri()
    moved = MlflowResource(target_family="demo", artifact_location=elsewhere).build()
    assert moved.get_version(first.version.version).source == first.version.source
    assert not (tmp_path / "elsewhere").exists()


def test_relocation_touches_only_the_moved_prefix(tmp_path):
    """A location that merely starts with the same characters (``.../aerie-drafter-demo2``)
    and other experiments' rows stay as they were."""
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE experiments (artifact_location TEXT)")
        c.execute("CREATE TABLE model_versions (source TEXT, storage_location TEXT)")
        c.executemany("INSERT INTO experiments VALUES (?)",
                      [("file:///a/exp",), ("file:///a/exp2",), ("file:///a/exp/run/x",)])
        c.execute("INSERT INTO model_versions VALUES (?, ?)",
                  ("file:///a/exp/r/drafter", "s3://other/exp/r"))
    (tmp_path / "b" / "exp").mkdir(parents=True)
    new = (tmp_path / "b" / "exp").as_uri()
    assert follow_moved_artifacts(f"sqlite:///{db}", None, "file:///a/exp", new) == 3
    with sqlite3.connect(db) as c:
        assert [r[0] for r in c.execute("SELECT * FROM experiments")] == [
            new, "file:///a/exp2", f"{new}/run/x"]
        assert c.execute("SELECT * FROM model_versions").fetchone() == (
            f"{new}/r/drafter", "s3://other/exp/r")
    assert follow_moved_artifacts(f"sqlite:///{db}", None, "file:///a/exp", new) == 0
    assert follow_moved_artifacts("http://mlflow:5000", None, "file:///a/exp", new) == 0


def test_a_postgres_tracking_store_brings_the_cross_host_lease(postgres, tmp_path,
                                                               monkeypatch):
    """MLflow on PostgreSQL: tracking and registry there, and promotions locked by the
    lease in the same database (no lock file on any host)."""
    from pipeline.release.lease import PostgresLease

    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    url = postgres.new_database("mlflow")
    resource = MlflowResource(tracking_uri=url.replace("postgresql://",
                                                       "postgresql+psycopg://"),
                              artifact_location=(tmp_path / "artifacts").as_uri())
    registry = resource.build()
    assert registry.lock_url == url
    reg = registry.publish(drafter_dir=make_drafter_dir(tmp_path / "d"),
                           lineage=lineage(uuid.uuid4().hex, "file:///s/drafters/x"))
    assert registry.get_version(reg.version.version).fingerprint == reg.version.fingerprint
    with registry.promotion_lock() as held:
        assert isinstance(held, PostgresLease) and held.token > 0
    assert not (tmp_path / "home" / "mlflow").exists()


def test_the_lease_url_must_be_postgres():
    import pytest

    with pytest.raises(ValueError, match="AERIE_PROMOTION_LOCK_URL must be a postgresql"):
        MlflowResource(lock_url="mysql://db/x").resolved_lock_url()
    assert MlflowResource(lock_url="postgres://u@h/db").resolved_lock_url() == \
        "postgresql://u@h/db"
    assert MlflowResource().resolved_lock_url() is None
