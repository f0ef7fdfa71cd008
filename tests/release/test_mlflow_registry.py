"""The drafter registry against embedded sqlite; the contract tests marked
:data:`on_every_registry` run against a real ``mlflow server`` process too (REST store,
proxied artifacts)."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest
from mlflow.artifacts import download_artifacts

from pipeline.release.lineage import LineageError
from pipeline.release.mlflow_registry import (
    CHALLENGER,
    CHAMPION,
    DrafterRegistry,
    model_name,
)
from tests.release.conftest import on_every_registry
from tests.release.helpers import lineage, make_drafter_dir

pytestmark = pytest.mark.integration

# a 1x1 PNG
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhf"
                       "DwAChwGA60e6kgAAAABJRU5ErkJggg==")
HISTORY = [{"step": s, "lr": 1e-4, "loss": 3.0 / s, "accuracy": [0.5, 0.3],
            "sim_accept_length": 1.5, "note": "text is skipped"} for s in (4, 8, 12)]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("reg") / "drafter")


@pytest.fixture
def chart(tmp_path):
    path = tmp_path / "acceptance.png"
    path.write_bytes(PNG)
    return path


def fp() -> str:
    return uuid.uuid4().hex


def publish(registry: DrafterRegistry, drafter_dir, fingerprint: str, **kw):
    return registry.publish(
        drafter_dir=drafter_dir, lineage=lineage(fingerprint, "file:///s/drafters/x", **kw),
        params={"lr": 1e-4, "ttt_depth": 3, "window": [8, 9, 10]}, history=HISTORY,
        metrics={"eval/tau": 2.5, "eval/alpha_1": 0.8}, charts=kw.pop("charts", ()))


@on_every_registry
def test_publish_logs_a_run_and_registers_a_tagged_version(registry, drafter_dir, chart,
                                                           tmp_path, monkeypatch):
    f = fp()
    reg = registry.publish(
        drafter_dir=drafter_dir, lineage=lineage(f, "file:///s/drafters/step=000010"),
        params={"lr": 1e-4, "window": [8, 9, 10]}, history=HISTORY,
        metrics={"eval/tau": 2.5, "eval/alpha_1": 0.8}, charts=[chart])
    v = reg.version
    assert not reg.reused and v.version == "1" and v.model == registry.model_name
    assert v.fingerprint == f and v.lineage["rl_step_window"] == [8, 9, 10]
    assert v.lineage["dagster_run_id"] == "run-123" and v.tags["tau"] == "2.5"
    assert all(isinstance(x, str) for x in v.tags.values())
    assert set(v.tags) == {"fingerprint", "rl_step", "tau", "lineage"}  # a few, not ~20
    run_tags = registry.client.get_run(reg.run_id).data.tags  # the run: one tag per key
    assert run_tags["rl_step_window"] == "[8,9,10]" and run_tags["dagster_run_id"] == "run-123"
    assert registry.alias(CHALLENGER) == "1" and registry.alias(CHAMPION) is None
    assert registry.champion() is None
    described = registry.client.get_model_version(registry.model_name, "1").description
    assert described == (f"Speculative-decoding drafter of {registry.model_name} for the "
                         f"policy of RL step "
                         f"10, trained on RL steps 8–10 (fingerprint {f[:12]}). τ 2.50 on "
                         f"held-out prompts. Gate: not decided yet.")
    card = registry.client.get_registered_model(registry.model_name).description
    assert "--speculative-draft-model-path" in card and "`champion`" in card
    assert "`aerie promote VERSION --reason WHY`" in card and "`aerie rollback`" in card
    # what an MLflow user fetches for a version: the SGLang directory, byte for byte
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.client.tracking_uri)
    fetched = Path(download_artifacts(artifact_uri=f"models:/{registry.model_name}/1",
                                      dst_path=str(tmp_path / "fetched")))
    assert {p.name: p.read_bytes() for p in fetched.iterdir()} == {
        p.name: p.read_bytes() for p in Path(drafter_dir).iterdir()}

    run = registry.client.get_run(reg.run_id)
    assert run.data.params["window"] == "[8,9,10]" and run.info.status == "FINISHED"
    assert run.data.metrics["eval/tau"] == 2.5
    loss = registry.client.get_metric_history(reg.run_id, "train/loss")
    assert [(m.step, round(m.value, 6)) for m in loss] == [(4, 0.75), (8, 0.375), (12, 0.25)]
    assert len(registry.client.get_metric_history(reg.run_id, "train/accuracy/1")) == 3
    assert "train/note" not in run.data.metrics
    listed = {a.path for a in registry.client.list_artifacts(reg.run_id, "charts")}
    assert listed == {"charts/acceptance.png"}

    local = Path(download_artifacts(artifact_uri=v.source, dst_path=str(tmp_path / "dl"),
                               tracking_uri=registry.client.tracking_uri))
    names = sorted(p.name for p in local.iterdir())
    assert names == ["config.json", "model.safetensors"]
    assert (drafter_dir / "model.safetensors").read_bytes() == \
        (local / "model.safetensors").read_bytes()


@on_every_registry
def test_republishing_a_fingerprint_returns_the_existing_version(registry, drafter_dir):
    f = fp()
    first = publish(registry, drafter_dir, f)
    again = publish(registry, drafter_dir, f)
    assert again.reused and again.version.version == first.version.version
    assert again.run_id == first.run_id
    assert [v.version for v in registry.versions()] == ["1"]
    runs = registry.client.search_runs([registry.runs.experiment_id()])
    assert len(runs) == 1

    other = publish(registry, drafter_dir, fp(), step=20)
    assert other.version.version == "2" and registry.alias(CHALLENGER) == "2"
    assert registry.find_version(f).version == "1"


@on_every_registry
def test_incomplete_lineage_registers_nothing(registry, drafter_dir):
    bad = lineage(fp(), "file:///x")
    del bad["policy_sha256"]
    with pytest.raises(LineageError, match="policy_sha256"):
        registry.publish(drafter_dir=drafter_dir, lineage=bad)
    assert registry.versions() == []
    assert registry.client.search_runs([registry.runs.experiment_id()]) == []


@on_every_registry
def test_aliases_are_read_back_from_the_server(registry, drafter_dir):
    publish(registry, drafter_dir, fp())
    publish(registry, drafter_dir, fp())
    registry.set_alias(CHAMPION, "1")
    other_view = DrafterRegistry(registry.client, registry.family)  # another process's view
    assert other_view.champion().version == "1"
    other_view.set_alias(CHAMPION, "2")
    assert registry.alias(CHAMPION) == "2"  # no caching: last writer wins, we see it
    registry.delete_alias(CHAMPION)
    assert registry.champion() is None


def test_a_crash_before_aliasing_is_repaired_on_retry(sqlite_registry, drafter_dir):
    registry, f = sqlite_registry, fp()
    run_id = registry.runs.start_run(f)
    source = registry.runs.log_drafter(run_id, drafter_dir)
    registry.runs.finish_run(run_id)
    registry.ensure_model()
    # as if the process died between create_model_version and the challenger alias
    registry.client.create_model_version(registry.model_name, source, run_id=run_id,
                                         tags={"fingerprint": f})
    assert registry.alias(CHALLENGER) is None
    reg = publish(registry, drafter_dir, f)
    assert reg.reused and registry.alias(CHALLENGER) == "1"


def test_a_finished_run_without_a_version_is_reused(sqlite_registry, drafter_dir):
    registry, f = sqlite_registry, fp()
    run_id = registry.runs.start_run(f, params={"a": 1})
    registry.runs.log_drafter(run_id, drafter_dir)
    registry.runs.finish_run(run_id)
    reg = publish(registry, drafter_dir, f)
    assert reg.run_id == run_id and not reg.reused
    assert len(registry.client.search_runs([registry.runs.experiment_id()])) == 1


def test_a_failed_upload_marks_the_run_failed(sqlite_registry, tmp_path):
    registry = sqlite_registry
    with pytest.raises(ValueError, match="not a drafter directory"):
        registry.publish(drafter_dir=tmp_path / "nothing", lineage=lineage(fp(), "file:///x"))
    (run,) = registry.client.search_runs([registry.runs.experiment_id()])
    assert run.info.status == "FAILED" and registry.versions() == []


def test_names_and_validation(sqlite_tracking):
    assert model_name("Llama-3.1 8B") == "aerie-drafter-llama-3.1-8b"
    with pytest.raises(ValueError):
        model_name("///")
    with pytest.raises(ValueError, match="artifact_location"):
        DrafterRegistry.connect(sqlite_tracking[0], "x")
    registry = DrafterRegistry.connect(sqlite_tracking[0], "x",
                                       artifact_location=sqlite_tracking[1])
    with pytest.raises(ValueError, match="fingerprint"):
        registry.find_version("x' or name != '")


def test_s3_artifact_location(sqlite_tracking, moto_endpoint, monkeypatch, drafter_dir):
    """Artifacts in S3 (moto) with the endpoint and keys from the environment."""
    import boto3

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "aerie-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aerie-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"mlflow-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=bucket)
    registry = DrafterRegistry.connect(sqlite_tracking[0], f"s3{uuid.uuid4().hex[:8]}",
                                       artifact_location=f"s3://{bucket}/mlflow")
    reg = publish(registry, drafter_dir, fp())
    assert reg.version.source.startswith(f"s3://{bucket}/mlflow/")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert any(k.endswith("drafter/model.safetensors") for k in keys)
