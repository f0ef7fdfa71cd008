"""Promotion locks for one host: an exclusive, crash-safe file lock, and a lock shared by the
threads of one process (the fallback when no lock file is configured). Across hosts:
:mod:`pipeline.release.lease`.

MLflow alias moves are last-writer-wins (no compare-and-set), so two promotions must never
interleave their read-champion → update-serving → move-alias sequences.

Invariants:

- The file lock is the ``filelock`` package's kernel lock (``flock`` on a file that is never
  deleted): the kernel releases it when the holder's file descriptor closes, including when
  the process dies, so a crash leaves no stale lock. Where the filesystem has no ``flock``
  it fails (``fallback_to_soft=False``) rather than fall back to an existence lock that a
  crash would leave behind.
- Each ``acquire`` opens its own descriptor, so two threads of one process exclude each
  other as two processes do.
- Waits at most ``timeout_s`` (polling every ``poll_s``), then raises :class:`LockTimeout`
  naming the lock file and the wait; never blocks forever.
- One host only: promotions from several machines need the lease of
  :mod:`pipeline.release.lease` (``AERIE_PROMOTION_LOCK_URL``).
- Neither lock hands out a fencing token (``token`` is None): on one host the kernel (or
  the process) ends a holder's lock only with the holder itself.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

import filelock


class LockTimeout(TimeoutError):
    """The lock stayed held by someone else for longer than the timeout."""


class FileLock:
    """``with FileLock(path):`` holds an exclusive lock on ``path`` (created if needed)."""

    token = None

    def __init__(self, path: str | Path, timeout_s: float = 120.0, poll_s: float = 0.05):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._lock: filelock.BaseFileLock | None = None

    def acquire(self) -> None:
        if self._lock is not None:
            raise RuntimeError(f"{self.path} is already held by this lock object")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a lock object per acquire (its own descriptor); not thread-local, so the thread
        # that releases need not be the one that acquired
        lock = filelock.FileLock(self.path, thread_local=False, fallback_to_soft=False)
        try:
            lock.acquire(timeout=self.timeout_s, poll_interval=self.poll_s)
        except filelock.Timeout:
            raise LockTimeout(f"{self.path} is held by another promotion "
                              f"(waited {self.timeout_s}s)") from None
        self._lock = lock

    def release(self) -> None:
        if self._lock is None:
            return
        lock, self._lock = self._lock, None
        lock.release()

    @property
    def held(self) -> bool:
        return self._lock is not None

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
