"""A separate environment with vLLM's speculators, for the peer-loader checks.

Built once per session: a venv layered on this one (a ``.pth`` line puts the project's
site-packages behind its own), with speculators installed (by this environment's pip)
without its declared pins and the few modules its import chain needs, every package the
project already has held at the project's version (``pip -c`` with this environment's
freeze); the ``.pth`` adds every site directory of this interpreter with
``site.addsitedir``, so their own ``.pth`` files (editable installs) apply too. There
``tests/matrix/speculators_load.py`` runs as one service process for the session
(:class:`Speculators`), stopped at the end. The environment is built and the service
started in a thread as soon as collection shows a test needs them (:class:`_Environment`):
the ~35 s of pip installs and speculators' imports overlap the tests that run first. When
the environment cannot be built (no package index), the checks are skipped locally and fail
in CI (``CI`` set): never silently skipped there.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# speculators 0.9.0 declares transformers<=5.19 and datasets<=5.1 (its training extras);
# its converter and loader run on the project's transformers 5.23, and datasets 5.2 is the
# first that accepts the project's fsspec.
PEER_PINS = ("speculators==0.9.0", "hs-connectors==0.9.0")
PEER_IMPORT_DEPS = ("loguru==0.7.3", "openai==3.54.0", "datasets==5.2.0")
LOADER = Path(__file__).with_name("speculators_load.py")
REPORT = "SPECULATORS-REPORT "


def _pip(python: Path, *args: str) -> None:
    """``pip install`` into the environment of ``python``, run by this environment's pip
    (the venv gets none: ``ensurepip`` costs ~8 s)."""
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--disable-pip-version-check", *args],
                   check=True, capture_output=True, text=True, timeout=600)


class Speculators:
    """The loader service in the speculators environment (one process per session)."""

    def __init__(self, python: Path, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.process = subprocess.Popen([str(python), str(LOADER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(REPORT):
                self.answers.put(line[len(REPORT):])
        self.answers.put(None)  # the service exited

    def load(self, drafter: Path, target: Path, out: Path) -> tuple[dict | None, str]:
        """``(report, "")``, or ``(None, error)`` when speculators refused the export."""
        assert self.process.stdin is not None
        request = {"drafter": str(drafter), "target": str(target), "out": str(out)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        try:
            line = self.answers.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer from the speculators loader in {self.timeout_s}s "
                               f"for {drafter}") from None
        if line is None:
            raise RuntimeError(f"the speculators loader exited ({self.process.wait()})")
        answer = json.loads(line)
        return (None, answer["error"]) if "error" in answer else (answer, "")

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, 9)
            self.process.wait()


def _build(root: Path) -> Path:
    """The speculators environment under ``root``; its python."""
    venv.create(root / "venv")
    python = root / "venv" / "bin" / "python"
    peer_site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(peer_site, "aerie-project.pth").write_text("".join(  # with their own .pth
        f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout
    constraints = root / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in freeze.splitlines()
                                   if "==" in line))
    _pip(python, "--no-deps", *PEER_PINS)
    _pip(python, *PEER_IMPORT_DEPS, "-c", str(constraints))
    return python


class _Environment:
    """The environment built, then the service started, in a thread of their own."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="aerie-speculators-"))
        self._thread = ThreadPoolExecutor(max_workers=1)
        self._service = self._thread.submit(lambda: Speculators(_build(self.root)))

    def service(self) -> Speculators:
        """The service, once started; what the build raised, if it failed."""
        return self._service.result()

    def stop(self) -> None:
        self._thread.shutdown(wait=True)
        if self._service.exception() is None:
            self._service.result().stop()
        shutil.rmtree(self.root, ignore_errors=True)


_environment: list[_Environment] = []


def pytest_collection_finish(session):
    # under xdist every worker collects every test but runs only some: built on demand
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    if any("speculators" in getattr(item, "fixturenames", ()) for item in session.items):
        _environment.append(_Environment())


def pytest_sessionfinish(session):
    while _environment:
        _environment.pop().stop()


@pytest.fixture(scope="session")
def speculators() -> Speculators:
    if not _environment:
        _environment.append(_Environment())
    try:
        return _environment[0].service()
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        message = f"cannot build the speculators environment: {detail[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
