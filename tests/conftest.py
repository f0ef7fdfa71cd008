"""Shared fixtures: a real S3 API server (moto_server) and a real PostgreSQL server on
loopback, storages to test against."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline.storage import Storage
from resources.home import CHECKOUT
from tests.tiers import (
    assign_tiers,
    guard_unit,
    module_scheduling,
    plan_for_workers,
    skip_module,
    tier_of,
)

# what would point a test at the user's state instead of its own temporary home
USER_STATE_ENV = ("AERIE_HOME", "DAGSTER_HOME", "AERIE_STORAGE_URL", "MLFLOW_TRACKING_URI",
                  "MLFLOW_REGISTRY_URI", "AERIE_CACHE_DIR", "AERIE_MLFLOW_UI_URL")
USER_HOME = CHECKOUT / ".aerie"  # the embedded default's state, e.g. after `aerie demo`
# where MLflow writes when nothing names a tracking store (its default: the working directory)
STRAY_MLFLOW = (CHECKOUT / "mlflow.db", CHECKOUT / "mlruns")
_USER_STATE = pytest.StashKey[dict]()


def state_digest(home: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every file under ``home``: any write changes one of them."""
    if not home.is_dir():
        return {}
    return {p.relative_to(home).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(home.rglob("*")) if p.is_file()}


def pytest_configure(config):
    """Every test runs against a temporary home, never the user's ``.aerie`` (checked at the
    end of the session). Under ``pytest -n N`` each worker's torch gets its share of the
    cores: N processes of all-core thread pools would fight over them."""
    for var in USER_STATE_ENV:
        os.environ.pop(var, None)
    home = Path(tempfile.mkdtemp(prefix="aerie-tests-home-"))
    (home / "dagster").mkdir()
    os.environ["AERIE_HOME"], os.environ["DAGSTER_HOME"] = str(home), str(home / "dagster")
    # where MLflow links point (the UI tests start MLflow there): a free port, not the 5000 a
    # user's own MLflow may hold; set before anything loads the definitions, which read it
    os.environ["AERIE_MLFLOW_UI_URL"] = f"http://127.0.0.1:{free_port()}"
    config.stash[_USER_STATE] = _user_state()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when any test wrote into the user's ``.aerie``."""
    before = session.config.stash.get(_USER_STATE, None)
    if before is None:
        return
    after = _user_state()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        session.config.get_terminal_writer().line(
            f"the tests changed {len(changed)} files of the user's state ({USER_HOME}, or "
            f"MLflow's default store in the checkout): "
            f"{changed[:5]}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _user_state() -> dict[str, tuple[int, int]]:
    """:func:`state_digest` of the user's ``.aerie``, and of MLflow's default store in the
    checkout (a test that used MLflow without naming a store would write there)."""
    state = state_digest(USER_HOME)
    for stray in STRAY_MLFLOW:
        if stray.is_file():
            state[stray.name] = (stray.stat().st_size, stray.stat().st_mtime_ns)
        elif stray.is_dir():
            state.update({f"{stray.name}/{k}": v for k, v in state_digest(stray).items()})
    return state


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    return module_scheduling(config, log)


def pytest_ignore_collect(collection_path, config):
    if skip_module(collection_path, config.getoption("markexpr") or ""):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    assign_tiers(items)
    plan_for_workers(items)


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    """A ``unit`` test may start no process, open no connection, create no Dagster instance
    (tests/tiers.py)."""
    if tier_of(request.node) == "unit":
        guard_unit(monkeypatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """The tests' one way to run a server: ``cmd`` started with its output in ``log_path``,
    ready when each port accepts connections on 127.0.0.1 and ``probe()`` (if given) is
    true, stopped by PID (its whole process group with ``group``): SIGTERM, then SIGKILL
    after ``grace_s``."""

    def __init__(self, cmd: Sequence[str], log_path: Path, *, group: bool = False, **popen):
        self.group = group
        self.log_path = log_path
        with open(log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=group, **popen)

    def wait_ready(self, ports: Iterable[int] = (), timeout: float = 60.0,
                   probe: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(ports)
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"server exited early with {self.proc.returncode}: {tail}")
            while waiting and _accepts(waiting[0]):
                waiting.pop(0)
            if not waiting and (probe is None or probe()):
                return
            if time.monotonic() > deadline:
                what = f"127.0.0.1:{waiting[0]}" if waiting else "its readiness probe"
                raise TimeoutError(f"server not ready after {timeout}s (waiting on {what})")
            time.sleep(0.05)

    def stop(self, grace_s: float = 60.0) -> None:
        kill = os.killpg if self.group else os.kill
        try:
            kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:  # gone already
            pass


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@contextmanager
def local_server(cmd: Sequence[str], log_path: Path, ports: Iterable[int], *,
                 timeout: float = 60.0, group: bool = False,
                 ready: Callable[[], None] | None = None, **popen) -> Iterator[None]:
    """:class:`ServerProcess` for a block: run ``cmd`` until every one of ``ports``
    accepts connections (``ready()`` runs first, while it starts), then yield; stopped on
    exit."""
    server = ServerProcess(cmd, log_path, group=group, **popen)
    try:
        if ready is not None:
            ready()
        server.wait_ready(ports, timeout)
        yield
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory) -> str:
    """A real S3 HTTP API on 127.0.0.1, stopped by PID at the end of the session."""
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    port = free_port()
    with local_server([exe, "-H", "127.0.0.1", "-p", str(port)],
                      tmp_path_factory.mktemp("moto") / "moto.log", [port]):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on 127.0.0.1 for the session (tests take their own database
    with ``postgres.new_database()``), stopped by PID at the end."""
    from bench.local_postgres import PostgresServer, postgres_bin

    try:
        postgres_bin("postgres")
    except RuntimeError as e:
        if os.environ.get("AERIE_REQUIRE_POSTGRES"):  # CI (.ci/run) installs it
            raise
        pytest.skip(str(e))
    server = PostgresServer(free_port())
    try:
        yield server
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict:
    return {"key": "aerie-test", "secret": "aerie-test-secret", "endpoint_url": endpoint,
            "skip_instance_cache": True}


STORAGE_BACKENDS = ("local", pytest.param("s3", marks=pytest.mark.integration))
# a test whose behaviour depends on the storage backend runs on each; the rest on local only
on_every_storage = pytest.mark.parametrize("storage", STORAGE_BACKENDS, indirect=True)


@pytest.fixture
def storage(request, tmp_path) -> Storage:
    """A Storage over a local directory; over S3 (moto_server) too where the test is marked
    :data:`on_every_storage` (the same contract on both)."""
    if getattr(request, "param", "local") == "local":
        return Storage(tmp_path.as_uri())
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"aerie-{uuid.uuid4().hex[:12]}"
    opts = s3_options(endpoint)
    probe = Storage(f"s3://{bucket}", opts)
    probe.fs.mkdir(bucket)
    return Storage(f"s3://{bucket}/root", opts)


@pytest.fixture(scope="session")
def world_root(tmp_path_factory) -> Path:
    """The tiny training world of tests/training/world.py (3 steps × 32 samples), built
    once per session; never written to."""
    from tests.training.world import build_world

    root = tmp_path_factory.mktemp("world") / "storage"
    build_world(root)
    return root





def ver(name: str) -> str:
    """The registry version in a drafter's name (``v2 (0123abcd)`` → ``2``)."""
    return name if name == "none" else name.split()[0].removeprefix("v")
