from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from pipeline.storage import Storage
from pipeline.training.config import TrainConfig
from pipeline.vocab import stage as vocab_stage

STEP = 3
WINDOW = 3
DRAFT_VOCAB = 64

# Small and quick: ~100 samples, TTT depth 3, one thread per rank (CI boxes are shared).
FAST = TrainConfig(lr=1e-3, warmup_ratio=0.1, micro_batch_size=4, epochs=2, ttt_depth=3,
                   threads=1, checkpoint_every=4, log_every=4, shuffle_buffer=24,
                   export_dtype="float32")


@pytest.fixture
def storage(world_root, tmp_path) -> Storage:
    """A private copy of the world, so that tests can add vocab mappings and drafters."""
    root = tmp_path / "storage"
    shutil.copytree(world_root, root)
    return Storage(root.as_uri())


@pytest.fixture
def vocab_storage(storage) -> Storage:
    """The world with the vocab stage done for ``STEP``."""
    vocab_stage.run(storage, STEP, WINDOW, DRAFT_VOCAB)
    return storage


def fast(**overrides) -> TrainConfig:
    return replace(FAST, **overrides)


# The reference run shared by the resume, 2-process and learning tests: 1 process, global
# batch 8 = micro batch 4 × 2 accumulation steps, 12 steps per epoch, 36 steps, ZeRO-2 fp32.
REFERENCE = fast(grad_accum=2, epochs=3)


@pytest.fixture(scope="session")
def shared_storage(world_root, tmp_path_factory) -> Storage:
    """A session-wide copy of the world with the vocab stage done (only read by tests)."""
    root = tmp_path_factory.mktemp("shared") / "storage"
    shutil.copytree(world_root, root)
    storage = Storage(root.as_uri())
    vocab_stage.run(storage, STEP, WINDOW, DRAFT_VOCAB)
    return storage


@pytest.fixture(scope="session")
def reference_run(shared_storage, tmp_path_factory):
    from pipeline.training.launch import launch
    from pipeline.training.stage import plan

    root = tmp_path_factory.mktemp("reference")
    return launch(plan(shared_storage, STEP, REFERENCE, root, "none"))
