"""The promotion lock excludes other holders (threads too) and never waits forever."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.release.lock import FileLock, LockTimeout


def test_second_holder_times_out_then_gets_it(tmp_path):
    path = tmp_path / "p.lock"
    with FileLock(path):
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match=re.escape(f"{path} is held by another "
                                                         "promotion (waited 0.3s)")):
            FileLock(path, timeout_s=0.3).acquire()
        assert 0.25 < time.monotonic() - t0 < 5
    with FileLock(path, timeout_s=0.3) as again:
        assert again.held


def test_threads_are_serialised(tmp_path):
    path, inside, overlaps = tmp_path / "p.lock", [], []

    def work():
        with FileLock(path, timeout_s=10, poll_s=0.005):
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(1)
            time.sleep(0.02)
            inside.pop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []


@pytest.mark.integration
def test_a_dead_holder_releases_the_lock(tmp_path):
    path = tmp_path / "p.lock"
    root = str(Path(__file__).resolve().parents[2])
    code = (f"import sys; sys.path.insert(0, {root!r}); "
            "from pipeline.release.lock import FileLock; "
            f"l = FileLock({str(path)!r}); l.acquire(); print('held', flush=True); "
            "import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(LockTimeout):
            FileLock(path, timeout_s=0.2).acquire()
    finally:
        proc.kill()
        proc.wait()
    with FileLock(path, timeout_s=2):
        pass


def test_a_lock_taken_in_one_thread_is_released_in_another(tmp_path):
    path = tmp_path / "p.lock"
    lock = FileLock(path, timeout_s=0.3)
    lock.acquire()
    with pytest.raises(RuntimeError, match="already held by this lock object"):
        lock.acquire()
    releaser = threading.Thread(target=lock.release)
    releaser.start()
    releaser.join()
    assert not lock.held
    with FileLock(path, timeout_s=0.3):
        assert path.exists()  # the lock file stays: deleting it would split waiters
