"""Hidden-state capture SIGKILLed again and again: each re-run keeps what was finished,
leaves no growing debris, and the step ends bit-identical to one uninterrupted run.

Every run is its own process (one thread, the same seeded tiny Llama), killed with SIGKILL
inside a backend call, as an OOM kill or a pre-empted node would; nothing in the process
gets to clean up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.capture.shards import read_shards_manifest
from pipeline.layout import shards_prefix
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.storage import Storage
from tests.capture.helpers import STEP, lengths, write_tokenized

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    from pipeline.capture import stage as capture_stage
    from pipeline.capture.hf import HFCaptureBackend
    from pipeline.storage import Storage
    from tests.capture.test_capture_hf import tiny_llama
    from tests.capture.test_extraction import CONFIG, STEP

    kill_at = int(sys.argv[2])  # the backend call that never returns (-1: none)
    inner = HFCaptureBackend(tiny_llama(layers=6, hidden=64), output_dtype=torch.bfloat16)

    class Dying:
        hidden_size, aux_layer_ids, calls = inner.hidden_size, inner.aux_layer_ids, 0

        def describe(self):
            return inner.describe()

        def capture(self, batch):
            if self.calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.calls += 1
            return inner.capture(batch)

    summary = capture_stage.run(Storage(sys.argv[1]), STEP, Dying(), CONFIG)
    print(summary.shards_reused, summary.shards)
""")


def capture(storage: Storage, kill_at: int = -1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CAPTURE, storage.root_url, str(kill_at)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)


def finished_shards(storage: Storage) -> int:
    return len(storage.list(f"{shards_prefix(STEP)}/_progress"))


def debris(storage: Storage) -> list[Path]:
    return [p for p in Path(storage.path(shards_prefix(STEP))).rglob("*")
            if p.is_file() and p.name.endswith(".tmp")]


def test_repeated_sigkill_resumes_to_the_uninterrupted_shards(tmp_path):
    clean, killed = (Storage((tmp_path / name).as_uri()) for name in ("clean", "killed"))
    for storage in (clean, killed):
        write_tokenized(storage, STEP, lengths(90))
    done = capture(clean)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [(f.path, f.bytes, f.sha256) for f in read_shards_manifest(clean, STEP).files]

    progress, leftovers = [], []
    for _ in range(3):  # killed in the 4th backend call of each run
        proc = capture(killed, kill_at=4)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert read_manifest(killed, shards_prefix(STEP)) is None  # never committed half
        progress.append(finished_shards(killed))
        leftovers.append(len(debris(killed)))
    assert progress == sorted(set(progress)) and progress[0] > 0  # each run got further
    assert max(leftovers) <= 1  # a run sweeps the dead one's temporaries: no growth

    last = capture(killed)
    assert last.returncode == 0, last.stderr[-3000:]
    reused, total = map(int, last.stdout.split()[-2:])
    assert reused == progress[-1] and total == len(expected)  # finished work kept, not redone
    manifest = read_shards_manifest(killed, STEP)
    assert [(f.path, f.bytes, f.sha256) for f in manifest.files] == expected
    assert verify_manifest(killed, shards_prefix(STEP), manifest) == []
    assert debris(killed) == []
