from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetMaterialization, DagsterInstance, instance_for_test

from assets.groups import DATA_ASSETS
from assets.partitions import step_key
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage
from resources.mlflow import MlflowResource
from resources.refresh import RefreshPolicyResource
from resources.storage import StorageResource
from tests.snapshot.conftest import good_record, make_policy_dir

DAGSTER_BACKENDS = ("sqlite", "postgres")
# a test whose behaviour depends on the instance's storage (run, event-log and partition
# queries, pools, what the tables hold) runs on each; the rest on SQLite only
on_every_dagster_backend = pytest.mark.parametrize("dagster_backend", DAGSTER_BACKENDS,
                                                   indirect=True)


@pytest.fixture
def dagster_backend(request) -> dict | None:
    """The instance storage an orchestration test runs on: Dagster's SQLite (None: the
    default), and where marked :data:`on_every_dagster_backend`, PostgreSQL
    (``dagster-postgres``) in a fresh database of a real server."""
    if getattr(request, "param", "sqlite") == "sqlite":
        return None
    url = request.getfixturevalue("postgres").new_database("dagster")
    return {"storage": {"postgres": {"postgres_url": dagster_postgres_url(url)}}}


def dagster_postgres_url(url: str) -> str:
    """``url`` with the driver Dagster's storage needs: SQLAlchemy 2.1 maps a bare
    ``postgresql://`` to psycopg 3, whose server-side parameters break dagster-postgres's
    ``NOTIFY run_events, $1``."""
    return url.replace("postgresql://", "postgresql+psycopg2://", 1)


@pytest.fixture
def instance(dagster_backend) -> DagsterInstance:
    with instance_for_test(overrides=dagster_backend) as inst:  # a temporary DAGSTER_HOME
        yield inst


def use_backend(home: Path, backend: dict | None) -> None:
    """Point the instance of ``home/dagster.yaml`` (Aerie's, written by
    ``prepare_dagster_home``) at ``backend``'s storage."""
    if backend is None:
        return
    config = home / "dagster.yaml"
    current = yaml.safe_load(config.read_text()) or {}
    config.write_text(yaml.safe_dump({**current, **backend}, sort_keys=False))


@pytest.fixture
def local_storage(tmp_path) -> tuple[Storage, StorageResource]:
    url = (tmp_path / "storage").as_uri()
    return Storage(url), StorageResource(url=url)


def write_step(storage: Storage, tmp_path, step: int, n_good: int = 8, n_bad: int = 0) -> None:
    records = [good_record(i, step) for i in range(n_good)]
    records += [{**good_record(1000 + i, step), "response_token_ids": [10**6]}
                for i in range(n_bad)]
    policy = make_policy_dir(tmp_path / f"policy-{step}")
    SnapshotWriter(storage).write_step(step, records, policy, step)


EMPTY_STORAGE = Path(tempfile.mkdtemp(prefix="aerie-refresh-tests-"))


def trigger_resources(policy=None, storage_url: str | None = None) -> dict:
    """What the refresh triggers are given: the policy, and where they read the serving
    drafter's acceptance (a storage root holding none unless a test writes it)."""
    return {"refresh": policy or RefreshPolicyResource(),
            "storage": StorageResource(url=storage_url or EMPTY_STORAGE.as_uri()),
            "mlflow": MlflowResource()}


def ingest(instance, *steps: int, assets=DATA_ASSETS) -> None:
    """Record the data assets of ``steps`` as materialized (runless events), as an ingest
    run would."""
    for s in steps:
        for name in assets:
            instance.report_runless_asset_event(
                AssetMaterialization(asset_key=AssetKey(name), partition=step_key(s)))


def refresh_job():
    """The ``drafter_refresh`` job of the definitions."""
    from definitions import defs

    return defs.resolve_job_def("drafter_refresh")
