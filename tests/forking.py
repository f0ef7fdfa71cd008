"""Child processes forked from a warm parent, for tests that start many short-lived ones.

A fresh ``python`` that imports torch, transformers or MLflow spends 3-10 s of CPU on the
imports alone; eight racing promoters or five capture runs paid that every time. Python's
``forkserver`` imports :data:`PRELOAD` once (at the first :func:`start` of a session) and
forks each child from there.

A forked child is still a process of its own: its own pid, memory, database sessions and
file locks, killed by ``SIGKILL`` like any other, its exit code in ``exitcode`` (``-9``
when killed). The server only imports: it opens no connection and runs no torch op, so no
child inherits such state (the threads two libraries start as they load, OpenBLAS's pool
and Arrow's jemalloc, prepare for fork themselves). A child runs ``target(*args)`` with its
stdout and stderr going to ``log`` (a traceback included), and exits without ``atexit``
handlers, as multiprocessing children do.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

# the modules whose functions run here, and what those import only when called (MLflow's
# client and its SQL stores: ~7 s of a promoter's start)
PRELOAD = ["tests.release.promoter", "tests.reliability.capture_run",
           "mlflow.store.tracking.sqlalchemy_store",
           "mlflow.store.model_registry.sqlalchemy_store"]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)  # takes effect when the server starts


def start(target: Callable[..., object], *args: object, log: Path) -> BaseProcess:
    """Start ``target(*args)`` in a forked child writing its output to ``log``."""
    proc = _CONTEXT.Process(target=_logged, args=(str(log), target, args))
    proc.start()
    return proc


def finish(proc: BaseProcess, timeout_s: float) -> int:
    """``proc``'s exit code; it is killed, and TimeoutError raised, past ``timeout_s``."""
    proc.join(timeout_s)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise TimeoutError(f"child {proc.pid} still running after {timeout_s} s: killed")
    return proc.exitcode


def _logged(log: str, target: Callable[..., object], args: tuple) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    target(*args)
