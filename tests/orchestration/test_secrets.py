"""Secrets reach the services that need them and nothing else.

A deployment's secrets go in as environment variables only: the capture engines' API key
(``AERIE_CAPTURE_ENGINE_API_KEY``), the S3 secret (``AWS_SECRET_ACCESS_KEY``). A capture run
configured wholly from the environment must succeed against a vLLM stand-in that refuses
requests without the key and an S3 server, on each Dagster storage backend; afterwards no
trace of either secret may be anywhere Aerie or Dagster writes: the run's event log, its run
config, the instance's files (SQLite databases, captured logs) or its PostgreSQL tables, and
every object in storage.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg2
import pytest
from dagster import DagsterInstance, EnvVar, materialize, serialize_value

from assets.shards import hidden_state_shards
from pipeline.capture.shards import read_shards_manifest
from pipeline.snapshot.policy import publish_policy
from pipeline.storage import Storage
from resources.capture import capture_from_env
from resources.storage import storage_from_env
from tests.capture.helpers import CONFIG, STEP, lengths, tiny_llama, write_tokenized
from tests.conftest import s3_options
from tests.orchestration.conftest import on_every_dagster_backend, use_backend
from tests.vllm_contract.fixtures import capture_stand_in

pytestmark = pytest.mark.integration

pytest.importorskip("torch")
LAYERS, AUX = 6, (0, 2, 3)  # the policy's layers and the ones captured


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tiny_llama(layers=LAYERS).save_pretrained(path)
    return path


def traces(secret: str, *, files: Path, rows: list[str], objects: Storage) -> list[str]:
    """Where ``secret`` appears: files under ``files``, ``rows`` (text), ``objects``."""
    found = [str(p) for p in files.rglob("*") if p.is_file() and secret.encode() in
             p.read_bytes()]
    found += [f"row: {r[:80]}" for r in rows if secret in r]
    found += [k for k in objects.list("") if secret.encode() in objects.read_bytes(k)]
    return found


def postgres_rows(url: str) -> list[str]:
    """Every row of every table of the database at ``url``, as text."""
    conn = psycopg2.connect(url.replace("postgresql+psycopg2://", "postgresql://"))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            tables = [t for (t,) in cur.fetchall()]
            rows = []
            for table in tables:
                cur.execute(f'SELECT t::text FROM "{table}" t')
                rows += [r for (r,) in cur.fetchall()]
        return rows
    finally:
        conn.close()


@on_every_dagster_backend
def test_secrets_reach_the_services_and_nowhere_else(tmp_path, monkeypatch, moto_endpoint,
                                                     policy_dir, dagster_backend):
    key, s3_secret = f"sentinel-key-{uuid.uuid4().hex}", f"sentinel-s3-{uuid.uuid4().hex}"
    bucket = f"aerie-{uuid.uuid4().hex[:12]}"
    opts = {**s3_options(moto_endpoint), "secret": s3_secret}
    Storage(f"s3://{bucket}", opts).fs.mkdir(bucket)
    storage = Storage(f"s3://{bucket}/aerie", opts)
    publish_policy(storage, STEP, policy_dir)
    write_tokenized(storage, STEP, lengths(4))
    files = tmp_path / "hidden-states"
    files.mkdir()
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    use_backend(home, dagster_backend)
    with capture_stand_in(policy_dir, files, AUX, LAYERS, api_key=key) as url:
        for var, value in {
                "AERIE_STORAGE_URL": f"s3://{bucket}/aerie", "AWS_ENDPOINT_URL": moto_endpoint,
                "AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": s3_secret,
                "AERIE_CAPTURE_BACKEND": "vllm", "AERIE_CAPTURE_VLLM_URLS": url,
                "AERIE_CAPTURE_VLLM_FILES_DIR": str(files),
                "AERIE_CAPTURE_AUX_LAYER_IDS": ",".join(map(str, AUX)),
                "AERIE_CAPTURE_ENGINE_API_KEY": key, "AERIE_CAPTURE_ENGINE_MAX_RETRIES": "0",
                "DAGSTER_HOME": str(home)}.items():
            monkeypatch.setenv(var, value)
        capture = capture_from_env()
        assert capture.engine.api_key == EnvVar("AERIE_CAPTURE_ENGINE_API_KEY")
        assert capture.backend == "vllm" and capture.aux_layer_ids == list(AUX)
        config = {"token_budget": CONFIG.token_budget, "heldout_fraction": 0.0}
        with DagsterInstance.get() as instance:
            instance.add_dynamic_partitions("rl_steps", [f"step-{STEP:06d}"])
            result = materialize(
                [hidden_state_shards], partition_key=f"step-{STEP:06d}", instance=instance,
                resources={"storage": storage_from_env(), "capture": capture},
                run_config={"ops": {"hidden_state_shards": {"config": config}}})
            assert result.success  # the stand-in refuses requests without the key
            run = instance.get_run_by_id(result.run_id)
            rows = [json.dumps(run.run_config), serialize_value(run)]
            rows += [serialize_value(e) for e in instance.all_logs(result.run_id)]
    assert read_shards_manifest(storage, STEP).meta["samples"] == 4
    if dagster_backend is not None:
        rows += postgres_rows(dagster_backend["storage"]["postgres"]["postgres_url"])
    for secret in (key, s3_secret):
        assert traces(secret, files=home, rows=rows, objects=storage) == []
    # the search finds what it looks for, wherever it looks
    (home / "planted.log").write_text(f"Authorization: Bearer {key}")
    storage.write_bytes("planted.json", json.dumps({"secret": s3_secret}).encode())
    assert traces(key, files=home, rows=[f"run config {key}"], objects=storage) == [
        str(home / "planted.log"), f"row: run config {key}"]
    assert traces(s3_secret, files=home, rows=[], objects=storage) == ["planted.json"]
