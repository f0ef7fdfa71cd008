"""Promotion and decision tests: a local storage whose serving ledger backs the sqlite
registry (this directory's ``storage`` replaces the root's local + S3 one), and three
drafters to register."""

from __future__ import annotations

import pytest

from pipeline.release.backend import LedgerBackend
from pipeline.release.ledger import ServingLedger
from pipeline.storage import Storage
from tests.release.helpers import SETTINGS, make_drafter_dir


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    return [make_drafter_dir(root / f"d{i}", seed=i) for i in range(3)]


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage((tmp_path / "storage").as_uri())


@pytest.fixture
def serving(storage, sqlite_registry) -> LedgerBackend:
    return LedgerBackend(ServingLedger(storage, sqlite_registry.model_name), SETTINGS)
