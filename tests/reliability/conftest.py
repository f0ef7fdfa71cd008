"""Fixtures of the snapshot reliability corpus: a tiny policy checkpoint and a written,
validated step to damage (built once, copied per case)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

from .snapshot_reference import STEP, VOCAB


def tiny_policy(path: Path) -> Path:
    """A stand-in HF checkpoint: ``config.json`` with the vocab size is all the writer reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return path


def good_rows(n: int) -> list[dict]:
    return [{"rollout_id": f"g{i}", "trainer_step": STEP, "generated_by_policy_version": STEP,
             "messages": [{"role": "user", "content": f"{i}+1?"},
                          {"role": "assistant", "content": f"{i + 1}"}],
             "prompt_token_ids": [1, 2, i % VOCAB], "response_token_ids": [3, (i + 1) % VOCAB],
             "response_loss_mask": [1, 1], "reward": i / 10, "finish_reason": "stop",
             "token_fidelity": "exact"} for i in range(n)]


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> Path:
    return tiny_policy(tmp_path_factory.mktemp("policy") / "checkpoint")


@pytest.fixture(scope="session")
def written_step(tmp_path_factory, policy_dir) -> Path:
    """A storage root holding step STEP: 6 good records and 2 quarantined, in two parts,
    written and validated."""
    root = tmp_path_factory.mktemp("template") / "store"
    storage = Storage(str(root))
    records = [*good_rows(6), {"rollout_id": "bad-0"}, {**good_rows(1)[0], "reward": "x",
                                                        "rollout_id": "bad-1"}]
    SnapshotWriter(storage, rows_per_file=4).write_step(STEP, records, policy_dir, STEP)
    snapshot_stage.run(storage, STEP, rows_per_file=4)
    return root


@pytest.fixture
def fresh_copy(written_step, tmp_path_factory):
    """A function making a private copy of the written step (one per hypothesis example)."""
    def copy() -> Storage:
        root = tmp_path_factory.mktemp("case") / "store"
        shutil.copytree(written_step, root)
        return Storage(str(root))
    return copy
