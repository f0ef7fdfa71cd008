"""An exclusive, crash-safe file lock that serialises promotions on one host.

MLflow alias moves are last-writer-wins (no compare-and-set), so two promotions must never
interleave their read-champion → update-serving → move-alias sequences.

Invariants:

- ``flock`` on a file that is never deleted: the kernel releases the lock when the holder's
  file descriptor closes, including when the process dies, so a crash leaves no stale lock.
- Each ``acquire`` opens its own descriptor, so two threads of one process exclude each
  other as two processes do.
- Waits at most ``timeout_s`` (polling), then raises :class:`LockTimeout`; never blocks
  forever.
- One host only: promotions from several machines against one MLflow server need an
  orchestrator-level guard as well (e.g. a Dagster concurrency pool of 1); the alias
  read-back in :mod:`pipeline.release.promotion` detects a lost race either way.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType


class LockTimeout(TimeoutError):
    """The lock stayed held by someone else for longer than the timeout."""


class FileLock:
    """``with FileLock(path):`` holds an exclusive lock on ``path`` (created if needed)."""

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
