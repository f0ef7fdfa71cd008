"""The MLflow resource: embedded default under AERIE_HOME, env-only secrets, telemetry off."""

from __future__ import annotations

import os
import uuid

from resources.mlflow import MlflowResource, mlflow_from_env
from tests.release.helpers import lineage, make_drafter_dir


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
