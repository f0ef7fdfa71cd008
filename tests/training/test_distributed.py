"""2 processes (torchrun, gloo, CPU) match 1 process on the same global batch, and resume.

1 process: micro batch 4 × 2 accumulation steps; 2 processes: micro batch 4 × 1 each. The
reader gives rank r every 2nd micro batch of the same global order, DeepSpeed averages the
gradients (1 process: each micro loss scaled by 1/2; 2 processes: all-reduce then / 2), so
the update is the same sum in a different order.

Tolerance: ``atol=1e-6, rtol=0`` on the fp32 weights after 36 AdamW steps at lr 1e-3. Each
micro batch's gradient is computed identically in both runs (same data, same weights, one
thread); halving is exact in binary floating point and a + b is commutative, so the only
rounding difference is the order of reductions across ZeRO-2 partitions (the gradient norm
that sets the clip coefficient), a relative ~1e-7 effect. Measured here: max |difference|
1.2e-7, i.e. one ulp of the RMSNorm weights (≈1.0, ulp 1.19e-7). 1e-6 is ~8 ulps at |w|≈1:
room for an unlucky rounding or two, while training moves weights by > 1e-3 (asserted) and a
wrong data split (every rank reading rank 0's micro batches) fails the test (checked by
mutation).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.records import to_dict
from pipeline.training.checkpoint import complete_checkpoints
from pipeline.training.launch import launch
from pipeline.training.loop import build_drafter
from pipeline.training.stage import plan

from .conftest import REFERENCE, STEP

ATOL = 1e-6


@pytest.mark.integration
def test_two_processes_match_one_on_the_same_global_batch(shared_storage, reference_run,
                                                          tmp_path):
    config = REFERENCE.__class__(**{**to_dict(REFERENCE), "world_size": 2, "grad_accum": 1})
    assert config.samples_per_step == REFERENCE.samples_per_step
    spec = plan(shared_storage, STEP, config, tmp_path, "none")
    two = launch(spec, launcher="torchrun")
    assert two.world_size == 2 and two.steps == reference_run.steps
    one_w = load_file(str(Path(reference_run.out_dir) / "model.safetensors"))
    two_w = load_file(str(Path(two.out_dir) / "model.safetensors"))
    diffs = {k: (one_w[k].double() - two_w[k].double()).abs().max().item() for k in one_w}
    init = build_drafter(spec, shared_storage)[0].state_dict()
    moved = max((one_w[k].double() - init[k].double()).abs().max().item() for k in one_w)
    print(f"max |1 proc - 2 procs| per tensor: {max(diffs.values()):.3g}")
    for name in one_w:
        torch.testing.assert_close(two_w[name], one_w[name], atol=ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # the metrics are all-reduced: both runs saw the same tokens and positions
    assert two.final["depth_count"] == reference_run.final["depth_count"]
    assert two.final["tokens"] == reference_run.final["tokens"]
    assert moved > 1000 * ATOL  # training moved the weights far beyond the tolerance

    # Resume with 2 ranks: each rank's ZeRO-2 partition of the masters and moments is
    # rebuilt from the unpartitioned checkpoint; the result is bit-identical.
    root = Path(spec.work_dir) / "checkpoints"
    kept = complete_checkpoints(root)
    shutil.rmtree(kept[-1])
    shutil.rmtree(spec.out_dir)
    again = launch(spec, launcher="torchrun")
    assert again.resumed_from_step == int(kept[-2].name.split("-")[1]) < two.steps
    again_w = load_file(str(Path(again.out_dir) / "model.safetensors"))
    for name in two_w:
        assert torch.equal(again_w[name], two_w[name]), name
