"""Which process owns a temporary file: ``<host>-<pid>`` tags, and whether their owner is
gone (for sweeping what a killed process left; storage and the dataset cache use them)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


def owner_tag() -> str:
    """``<host>-<pid>`` of this process, without dots (temporary names split on them)."""
    return f"{socket.gethostname().replace('.', '_')}-{os.getpid()}"


def owner_gone(owner: str) -> bool | None:
    """Whether the process of an :func:`owner_tag` is gone: True/False for this host's
    processes, None for another host's (or a tag that is not one)."""
    host, _, pid = owner.rpartition("-")
    if host != owner_tag().rpartition("-")[0] or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except FileNotFoundError:
        return False
