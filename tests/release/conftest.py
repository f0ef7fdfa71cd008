"""Registries to test against: embedded sqlite, and a real ``mlflow server`` on loopback."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import requests

from pipeline.release.mlflow_registry import DrafterRegistry
from tests.conftest import ServerProcess, free_port

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture(scope="session")
def sqlite_tracking(tmp_path_factory) -> tuple[str, str]:
    """One sqlite tracking+registry store for the session (tests use their own families)."""
    root = tmp_path_factory.mktemp("mlflow-sqlite")
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


class _MlflowServer:
    """``mlflow server`` (sqlite backend, local artifact root, one worker) on 127.0.0.1.

    Started as soon as collection shows a test needs it (its ~15 s start overlaps the tests
    that run first), ready when ``/health`` answers (polled), stopped by PID with its whole
    process group (uvicorn worker included).
    """

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="aerie-mlflow-server-"))
        exe = shutil.which("mlflow") or str(Path(sys.executable).parent / "mlflow")
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.server = ServerProcess(
            [exe, "server", "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", (self.root / "artifacts").as_uri()],
            self.root / "server.log", group=True, env=env)

    def wait_healthy(self, timeout_s: float = 120.0) -> str:
        self.server.wait_ready(timeout=timeout_s, probe=self._healthy)
        return self.url

    def _healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        self.server.stop(grace_s=5)
        shutil.rmtree(self.root, ignore_errors=True)


_server: list[_MlflowServer] = []


def _needs_server(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return ("mlflow_server" in getattr(item, "fixturenames", ())
            or (callspec is not None and callspec.params.get("registry") == "server"))


def pytest_collection_finish(session):
    # under xdist every worker collects every test but runs only some: start it on demand
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(_needs_server(item) for item in session.items):
        _server.append(_MlflowServer())


def pytest_sessionfinish(session):
    while _server:
        _server.pop().stop()


@pytest.fixture(scope="session")
def mlflow_server() -> str:
    if not _server:
        _server.append(_MlflowServer())
    return _server[0].wait_healthy()


def new_family() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


REGISTRY_BACKENDS = ("sqlite", pytest.param("server", marks=pytest.mark.integration))
# a registry behaviour that depends on the store (MLflow's REST API, proxied artifacts)
# runs on each; the rest on embedded sqlite only
on_every_registry = pytest.mark.parametrize("registry", REGISTRY_BACKENDS, indirect=True)


@pytest.fixture
def registry(request, tmp_path) -> DrafterRegistry:
    """A registry on embedded sqlite; on a real ``mlflow server`` too where the test is
    marked :data:`on_every_registry`."""
    if getattr(request, "param", "sqlite") == "sqlite":
        return request.getfixturevalue("sqlite_registry")
    registry = DrafterRegistry.connect(request.getfixturevalue("mlflow_server"), new_family(),
                                       lock_path=tmp_path / "promotion.lock", lock_timeout_s=5)
    assert registry.client.tracking_uri.startswith("http://127.0.0.1:")
    return registry


@pytest.fixture
def sqlite_registry(sqlite_tracking, tmp_path) -> DrafterRegistry:
    tracking, artifacts = sqlite_tracking
    return DrafterRegistry.connect(tracking, new_family(), artifact_location=artifacts,
                                   lock_path=tmp_path / "promotion.lock", lock_timeout_s=5)
