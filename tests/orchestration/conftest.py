from __future__ import annotations

import pytest
from dagster import DagsterInstance, instance_for_test

from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage
from resources.storage import StorageResource
from tests.snapshot.conftest import good_record, make_policy_dir


@pytest.fixture
def instance() -> DagsterInstance:
    with instance_for_test() as inst:  # sqlite under a temporary DAGSTER_HOME
        yield inst


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
