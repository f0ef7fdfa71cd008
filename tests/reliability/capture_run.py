"""One capture run of the SIGKILL test (:mod:`tests.reliability.test_killed_capture`), in a
process of its own (forked by :mod:`tests.forking`): one thread, the same seeded tiny Llama
every run, and a backend that kills its own process with SIGKILL inside a chosen call, as an
OOM kill or a pre-empted node would; nothing in the process gets to clean up.
"""

from __future__ import annotations

import os
import signal

import torch

from pipeline.capture import stage as capture_stage
from pipeline.capture.hf import HFCaptureBackend
from pipeline.storage import Storage
from tests.capture.helpers import CONFIG, STEP, tiny_llama


class Dying:
    """``inner``, except that backend call number ``kill_at`` never returns (-1: none)."""

    def __init__(self, inner: HFCaptureBackend, kill_at: int):
        self.inner, self.kill_at, self.calls = inner, kill_at, 0
        self.hidden_size, self.aux_layer_ids = inner.hidden_size, inner.aux_layer_ids

    def describe(self):
        return self.inner.describe()

    def capture(self, batch):
        if self.calls == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1
        return self.inner.capture(batch)


def run(storage_url: str, kill_at: int) -> None:
    """Capture step STEP into ``storage_url``; print the shards reused and the shards."""
    torch.set_num_threads(1)
    inner = HFCaptureBackend(tiny_llama(layers=6, hidden=64), output_dtype=torch.bfloat16)
    summary = capture_stage.run(Storage(storage_url), STEP, Dying(inner, kill_at), CONFIG)
    print(summary.shards_reused, summary.shards)
