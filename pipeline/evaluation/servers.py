"""Evaluation servers that Aerie starts and stops itself: one engine process per contestant,
launched from the deployment's command template (:class:`EngineServers`), healthy within a
bound, and stopped by process group whatever happens.

Invariants:

- No shell: the template is an argv list filled item by item (:mod:`pipeline.argv_template`);
  the filled command line is never logged (it may carry tokens), only the executable's name.
- Bounded start: the server must answer ``GET /health`` with 200 within
  ``health_timeout_s``; a process that exits first, or a server still unhealthy at the bound,
  is an :class:`EngineStartError` naming the contestant, with the tail of its log.
- Stopped by PID: the process runs in its own session; on leaving :func:`launched`, also on
  an error, its whole process group gets SIGTERM, then whatever is left of the group SIGKILL
  after ``stop_timeout_s``; the next server starts only once the group is gone. (A template
  that hands the server to another supervisor, e.g. ``docker run`` without ``--rm --init``
  and a stop signal that reaches the container, escapes this: run the engine as a child.)
- Secrets: the template and the servers' logs may name tokens. The filled command line is
  never logged or recorded, and the log tail in an error has every ``api_key``/``token``/
  ``secret``/``password`` value redacted (:func:`redact`). The template itself is resource
  configuration, which Dagster shows: keep secrets in the servers' environment (they inherit
  Aerie's), never in the template.
- A request that fails while the process has exited is reported as
  :class:`EngineDiedError` (:meth:`LaunchedServer.explain`), not as a transport error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from pipeline.argv_template import check_template, expand

log = logging.getLogger(__name__)

# {policy_dir}: the refresh step's policy checkpoint (local, verified); {port}/{host}: where
# the server must listen; {speculative_args}: the engine's flags for the contestant's drafter
# (no items for no drafter), standing alone as one item of the template.
PLACEHOLDERS = frozenset({"policy_dir", "port", "host", "speculative_args"})
REQUIRED = ("policy_dir", "port", "speculative_args")
_TAIL = 2000


class EngineStartError(RuntimeError):
    """An evaluation server did not become healthy (or its process exited first)."""


class EngineDiedError(RuntimeError):
    """An evaluation server's process exited while it was being measured."""


class EngineStopError(RuntimeError):
    """An evaluation server's processes outlived SIGKILL."""


@dataclass(frozen=True)
class EngineServers:
    """How an engine evaluator brings up a server per contestant.

    ``launch``: the command template (argv; placeholders in :data:`PLACEHOLDERS`). The
    engine's parallelism and any other flags are the template's. ``host``: where the servers
    listen and are reached; ``health_timeout_s``: bound on a start; ``request_timeout_s``:
    bound on one request; ``concurrency``: requests in flight at once; ``log_dir``: where
    each server's output is kept (unset: a temporary directory, removed afterwards);
    ``tie_nats``: a greedy divergence from the no-drafter server is a near-tie, not a
    failure, when the two tokens are that server's two likeliest and their
    log-probabilities differ by at most this (0: none is).
    """

    launch: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    health_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    concurrency: int = 8
    stop_timeout_s: float = 30.0
    log_dir: str | None = None
    tie_nats: float = 0.5

    def __post_init__(self) -> None:
        if self.health_timeout_s <= 0 or self.request_timeout_s <= 0 \
                or self.stop_timeout_s <= 0 or self.concurrency < 1:
            raise ValueError("timeouts must be > 0 and concurrency >= 1")
        if not 0 <= self.tie_nats < float("inf"):
            raise ValueError(f"tie_nats must be a number >= 0, got {self.tie_nats}")

    def check(self, what: str) -> None:
        """Refuse a template that cannot start a contestant's server, naming ``what``."""
        check_template(self.launch, PLACEHOLDERS, required=REQUIRED,
                       lists=("speculative_args",), what=what)

    def record(self) -> dict[str, object]:
        """What the report keeps of this configuration: the executable's name, never the
        command line (it may carry tokens)."""
        return {"executable": Path(self.launch[0]).name if self.launch else None,
                "host": self.host, "tie_nats": self.tie_nats}


@dataclass
class LaunchedServer:
    """One running evaluation server."""

    label: str  # e.g. "sglang server for candidate"
    url: str
    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        """The end of the server's log, secrets redacted (engines log their arguments)."""
        try:
            data = self.log_path.read_bytes()[-_TAIL:]
        except OSError:
            return ""
        return redact(data.decode(errors="replace").strip())

    def explain(self, error: BaseException) -> BaseException:
        """``error`` as it should be reported: an :class:`EngineDiedError` with the log's
        tail when the process has exited, else ``error`` itself."""
        code = self.proc.poll()
        if code is None:
            return error
        return EngineDiedError(f"{self.label} (pid {self.proc.pid}) exited with status "
                               f"{code} while it was being measured ({error}); log "
                               f"{self.log_path}, tail:\n{self.tail()}")


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now (the server binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(servers: EngineServers, label: str, policy_dir: Path,
             speculative_args: Sequence[str], log_dir: Path) -> Iterator[LaunchedServer]:
    """A healthy server started from ``servers.launch`` for ``policy_dir`` with
    ``speculative_args``; stopped (its process group) on exit."""
    port = free_port(servers.host)
    argv = expand(servers.launch, {"policy_dir": str(policy_dir), "port": port,
                                   "host": servers.host},
                  {"speculative_args": list(speculative_args)})
    log_path = log_dir / f"{label.replace(' ', '_')}.log"
    log.info("%s: starting %s on %s:%d", label, Path(argv[0]).name, servers.host, port)
    with open(log_path, "ab") as out:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise EngineStartError(f"{label}: cannot run {Path(argv[0]).name}: {e}") from e
    server = LaunchedServer(label, f"http://{servers.host}:{port}", proc, log_path)
    try:
        _wait_healthy(server, servers.health_timeout_s)
        yield server
    finally:
        _stop(proc, servers.stop_timeout_s)


def _wait_healthy(server: LaunchedServer, timeout_s: float) -> None:
    started = time.monotonic()
    last = "no answer"
    while True:
        code = server.proc.poll()
        if code is not None:
            raise EngineStartError(f"{server.label} exited with status {code} before it was "
                                   f"healthy; log {server.log_path}, tail:\n{server.tail()}")
        try:
            r = requests.get(server.url + "/health", timeout=5)
            if r.status_code == 200:
                log.info("%s healthy after %.1f s", server.label, time.monotonic() - started)
                return
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = type(e).__name__
        if time.monotonic() - started > timeout_s:
            raise EngineStartError(f"{server.label} was not healthy within {timeout_s:g} s "
                                   f"(last /health: {last}); log {server.log_path}, tail:\n"
                                   f"{server.tail()}")
        time.sleep(0.25)


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of the group after
    ``timeout_s``; returns once the whole group is gone (the next contestant's server may
    need its GPUs), else raises :class:`EngineStopError` naming the group, unless an error
    is already on its way out."""
    group = proc.pid  # the leader's pid: it started a session, so its group has this id
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)  # the server and everything it started
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)  # reap the leader
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group_alive(group):
            return
    message = (f"process group {group} of an evaluation server survived SIGKILL for 10 s; "
               f"stop it by hand before the next evaluation")
    if sys.exc_info()[1] is None:
        raise EngineStopError(message)
    log.error(message)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed its credentials: still there
        return True
    return True


# what a server's log may print of its arguments: a secret's value after its name
_SECRET = re.compile(r"(?i)((?:api[_-]?key|token|secret|password)['\"]?\s*[:=]?\s*['\"]?)"
                     r"[^\s'\",)}]+")


def redact(text: str) -> str:
    """``text`` with the value of every ``api_key``/``--api-key``/``hf_token``/``password``
    (and the like) it names replaced by ``***``."""
    return _SECRET.sub(r"\1***", text)
