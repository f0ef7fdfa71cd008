"""rollout_snapshot materialized in-process: metadata, check results, S3 via EnvVar."""

from __future__ import annotations

import uuid

import pytest
from dagster import AssetKey, EnvVar, materialize

from assets.snapshots import rollout_snapshot
from pipeline.storage import Storage
from resources.storage import StorageResource, storage_from_env
from tests.conftest import s3_options

from .conftest import write_step

pytestmark = pytest.mark.integration


def run(instance, resource, key):
    instance.add_dynamic_partitions("rl_steps", [key])
    return materialize([rollout_snapshot], partition_key=key, instance=instance,
                       resources={"storage": resource})


def materialization_metadata(result):
    (event,) = result.get_asset_materialization_events()
    return event.materialization.metadata


def check_passed(result) -> bool:
    (evaluation,) = result.get_asset_check_evaluations()
    return evaluation.passed


def test_materialization_reports_counts_and_passes_the_check(instance, local_storage, tmp_path):
    storage, resource = local_storage
    write_step(storage, tmp_path, 4, n_good=40, n_bad=1)
    result = run(instance, resource, "step-000004")
    meta = materialization_metadata(result)
    assert meta["records"].value == 41 and meta["accepted"].value == 40
    assert meta["quarantined"].value == 1
    assert "outside the tokenizer's range" in meta["quarantine_reasons"].value
    assert meta["policy_uri"].value == storage.url("policies/step=000004")
    assert check_passed(result)
    assert instance.get_materialized_partitions(AssetKey("rollout_snapshot")) == {"step-000004"}


def test_check_fails_when_too_much_is_quarantined(instance, local_storage, tmp_path):
    storage, resource = local_storage
    write_step(storage, tmp_path, 5, n_good=10, n_bad=5)
    assert not check_passed(run(instance, resource, "step-000005"))


def test_s3_storage_with_secrets_from_env_vars(instance, moto_endpoint, tmp_path, monkeypatch):
    opts = s3_options(moto_endpoint)
    bucket = f"aerie-{uuid.uuid4().hex[:12]}"
    Storage(f"s3://{bucket}", opts).fs.mkdir(bucket)
    storage = Storage(f"s3://{bucket}/aerie", opts)
    write_step(storage, tmp_path, 6)
    monkeypatch.setenv("AERIE_STORAGE_URL", f"s3://{bucket}/aerie")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    resource = storage_from_env()
    assert resource.secret_access_key == EnvVar("AWS_SECRET_ACCESS_KEY")  # not the value
    result = run(instance, resource, "step-000006")
    assert materialization_metadata(result)["accepted"].value == 8
    assert storage.exists("snapshots/step=000006/_manifest.json")


def test_unset_environment_means_the_embedded_default(monkeypatch, tmp_path):
    for var in ("AERIE_STORAGE_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    resource = storage_from_env()
    assert resource == StorageResource()
    assert resource.build().root_url == (tmp_path / "home" / "storage").as_uri()
