"""Hidden-state capture SIGKILLed again and again: each re-run keeps what was finished,
leaves no growing debris, and the step ends bit-identical to one uninterrupted run.

Every run is its own process (:mod:`tests.reliability.capture_run`: one thread, the same
seeded tiny Llama), killed with SIGKILL inside a backend call, as an OOM kill or a
pre-empted node would; nothing in the process gets to clean up. The runs are forked from a
warm parent (:mod:`tests.forking`): each started python used to spend ~8 s importing torch
and transformers.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from pipeline.capture.shards import read_shards_manifest
from pipeline.layout import shards_prefix
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.storage import Storage
from tests import forking
from tests.capture.helpers import STEP, lengths, write_tokenized
from tests.reliability import capture_run

pytestmark = pytest.mark.integration


def capture(storage: Storage, log: Path, kill_at: int = -1) -> tuple[int, str]:
    """A capture run in a process of its own (:mod:`tests.reliability.capture_run`): its
    exit code and its output."""
    log.unlink(missing_ok=True)
    proc = forking.start(capture_run.run, storage.root_url, kill_at, log=log)
    return forking.finish(proc, timeout_s=600), log.read_text()


def finished_shards(storage: Storage) -> int:
    return len(storage.list(f"{shards_prefix(STEP)}/_progress"))


def debris(storage: Storage) -> list[Path]:
    return [p for p in Path(storage.path(shards_prefix(STEP))).rglob("*")
            if p.is_file() and p.name.endswith(".tmp")]


def test_repeated_sigkill_resumes_to_the_uninterrupted_shards(tmp_path):
    clean, killed = (Storage((tmp_path / name).as_uri()) for name in ("clean", "killed"))
    for storage in (clean, killed):
        write_tokenized(storage, STEP, lengths(90))
    code, log = capture(clean, tmp_path / "clean.log")
    assert code == 0, log[-3000:]
    expected = [(f.path, f.bytes, f.sha256) for f in read_shards_manifest(clean, STEP).files]

    progress, leftovers = [], []
    for _ in range(3):  # killed in the 4th backend call of each run
        code, log = capture(killed, tmp_path / "killed.log", kill_at=4)
        assert code == -signal.SIGKILL, log[-3000:]
        assert read_manifest(killed, shards_prefix(STEP)) is None  # never committed half
        progress.append(finished_shards(killed))
        leftovers.append(len(debris(killed)))
    assert progress == sorted(set(progress)) and progress[0] > 0  # each run got further
    assert max(leftovers) <= 1  # a run sweeps the dead one's temporaries: no growth

    code, log = capture(killed, tmp_path / "last.log")
    assert code == 0, log[-3000:]
    reused, total = map(int, log.split()[-2:])
    assert reused == progress[-1] and total == len(expected)  # finished work kept, not redone
    manifest = read_shards_manifest(killed, STEP)
    assert [(f.path, f.bytes, f.sha256) for f in manifest.files] == expected
    assert verify_manifest(killed, shards_prefix(STEP), manifest) == []
    assert debris(killed) == []
