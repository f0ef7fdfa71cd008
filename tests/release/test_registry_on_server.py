"""The registry contract against a real ``mlflow server`` process (REST store, proxied
artifacts): the same test functions as ``test_mlflow_registry``, with the server-backed
``registry`` fixture below. This module sorts after the sqlite-only ones so that the
server's start-up overlaps them (see ``conftest._MlflowServer``)."""

from __future__ import annotations

import pytest

from pipeline.release.mlflow_registry import DrafterRegistry
from tests.release.conftest import new_family
from tests.release.test_mlflow_registry import (  # noqa: F401 - re-collected here
    chart,
    drafter_dir,
    test_aliases_are_read_back_from_the_server,
    test_incomplete_lineage_registers_nothing,
    test_publish_logs_a_run_and_registers_a_tagged_version,
    test_republishing_a_fingerprint_returns_the_existing_version,
)


@pytest.fixture
def registry(mlflow_server, tmp_path) -> DrafterRegistry:
    registry = DrafterRegistry.connect(mlflow_server, new_family(),
                                       lock_path=tmp_path / "promotion.lock", lock_timeout_s=5)
    assert registry.client.tracking_uri.startswith("http://127.0.0.1:")
    return registry
