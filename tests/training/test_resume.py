"""Full resume: a run SIGKILLed mid-way and resumed ends bit-identical to an uninterrupted one.

Training runs in child processes exactly as in production (``launch``/``TrainingProcess``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.training.checkpoint import MARKER, checkpoint_name, complete_checkpoints
from pipeline.training.launch import TrainingProcess, launch
from pipeline.training.loop import RESULT_NAME
from pipeline.training.stage import plan

from .conftest import REFERENCE, STEP, fast


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.out_dir) / "model.safetensors"))


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def wait_for_checkpoint(proc: TrainingProcess, root: Path, timeout: float = 300.0) -> None:
    """Poll (no fixed sleep) until a complete checkpoint exists; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while not complete_checkpoints(root):
        assert proc.proc.poll() is None, "training ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)


@pytest.mark.integration
def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_weights(shared_storage,
                                                                     reference_run, tmp_path):
    reference = reference_run  # 36 optimizer steps, a checkpoint every 4
    total = reference.steps
    assert total == 36 and reference.resumed_from_step is None

    spec = plan(shared_storage, STEP, REFERENCE, tmp_path, "none")
    root = Path(spec.work_dir) / "checkpoints"
    proc = TrainingProcess(spec)
    wait_for_checkpoint(proc, root)
    proc.kill()  # SIGKILL to the run's process group
    assert not (Path(spec.work_dir) / RESULT_NAME).exists(), "the run finished before the kill"
    done = [int(p.name.split("-")[1]) for p in complete_checkpoints(root)]
    assert 0 < max(done) < total - 8  # mid-way, before the torn checkpoints made below

    # Torn checkpoints of later steps must be ignored: one without the marker, one whose
    # files no longer match it.
    newest = complete_checkpoints(root)[-1]
    torn = root / checkpoint_name(total - 4)
    shutil.copytree(newest, torn)
    (torn / MARKER).unlink()
    tampered = root / checkpoint_name(total - 8)
    shutil.copytree(newest, tampered)
    model = load_file(str(tampered / "model.safetensors"))
    save_file({k: v + 1 for k, v in model.items()}, str(tampered / "model.safetensors"))

    resumed = launch(spec)
    assert resumed.resumed_from_step == max(done)
    assert resumed.steps == total
    assert_identical(weights(resumed), weights(reference))
    assert resumed.final == reference.final  # metric history survived the kill too
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in reference.history]


@pytest.mark.integration
def test_resume_from_a_middle_checkpoint_with_bf16_zero1(vocab_storage, tmp_path):
    """bf16 ZeRO-1 (DeepSpeed's BF16_Optimizer, a third optimizer layout) resumes exactly too.

    (ZeRO-2 is the SIGKILL test above and the 2-process test; the plain ZeRO-0 optimizer's
    state round trip is tested in-process in test_checkpoint.py, and ZeRO-0 trains end to end
    in test_assets.py.)
    """
    config = fast(max_steps=12, zero_stage=1, dtype="bf16")
    spec = plan(vocab_storage, STEP, config, tmp_path, "none")
    full = launch(spec)
    first = weights(full)
    root = Path(spec.work_dir) / "checkpoints"
    kept = complete_checkpoints(root)
    assert [p.name for p in kept] == [checkpoint_name(8), checkpoint_name(12)]
    shutil.rmtree(kept[-1])  # as if killed after step 8's checkpoint
    shutil.rmtree(spec.out_dir)
    again = launch(spec)
    assert again.resumed_from_step == 8
    assert_identical(weights(again), first)
    state = json.loads((root / checkpoint_name(12) / "state.json").read_text())
    assert state["optimizer_step"] == 12 and state["extra"]["position"]["micro_batch"] == 12
