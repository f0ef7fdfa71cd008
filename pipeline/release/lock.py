"""Promotion locks for one host: an exclusive, crash-safe file lock, and a lock shared by the
threads of one process (the fallback when no lock file is configured). Across hosts:
:mod:`pipeline.release.lease`.

MLflow alias moves are last-writer-wins (no compare-and-set), so two promotions must never
interleave their read-champion → update-serving → move-alias sequences.

Invariants:

- ``flock`` on a file that is never deleted: the kernel releases the lock when the holder's
  file descriptor closes, including when the process dies, so a crash leaves no stale lock.
- Each ``acquire`` opens its own descriptor, so two threads of one process exclude each
  other as two processes do.
- Waits at most ``timeout_s`` (polling), then raises :class:`LockTimeout`; never blocks
  forever.
- One host only: promotions from several machines need the lease of
  :mod:`pipeline.release.lease` (``AERIE_PROMOTION_LOCK_URL``).
- Neither lock hands out a fencing token (``token`` is None): on one host the kernel (or
  the process) ends a holder's lock only with the holder itself.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from types import TracebackType


class LockTimeout(TimeoutError):
    """The lock stayed held by someone else for longer than the timeout."""


class FileLock:
    """``with FileLock(path):`` holds an exclusive lock on ``path`` (created if needed)."""

    token = None

    def __init__(self, path: str | Path, timeout_s: float = 120.0, poll_s: float = 0.05):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this lock object")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise LockTimeout(f"{self.path} is held by another promotion "
                                      f"(waited {self.timeout_s}s)") from None
                time.sleep(self.poll_s)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class ProcessLock:
    """``with ProcessLock(name):`` excludes the other threads of this process holding the
    lock of ``name``."""

    token = None
    _locks: dict[str, threading.Lock] = {}
    _guard = threading.Lock()

    def __init__(self, name: str, timeout_s: float = 120.0):
        self.name = name
        self.timeout_s = timeout_s
        with self._guard:
            self._lock = self._locks.setdefault(name, threading.Lock())

    def __enter__(self) -> ProcessLock:
        if not self._lock.acquire(timeout=self.timeout_s):
            raise LockTimeout(f"promotion lock of {self.name} held for more than "
                              f"{self.timeout_s}s")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()
