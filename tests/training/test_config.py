"""TrainConfig validation, the learning-rate schedule, the DeepSpeed config, the Dagster mirror."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from assets.drafter import DrafterRunConfig
from pipeline.records import from_dict, to_dict
from pipeline.training.config import (
    TrainConfig,
    deepspeed_config,
    lr_factor,
    total_steps,
    warmup_steps,
)
from resources.trainer import EXECUTION_FIELDS, TrainerResource


def test_defaults_follow_the_eagle3_anchors():
    c = TrainConfig()
    assert (c.lr, c.weight_decay, c.warmup_ratio, c.grad_clip, c.ttt_depth, c.max_length) == (
        1e-4, 0.0, 0.015, 0.5, 7, 2048)
    assert c.zero_stage == 2 and c.world_size == 1


@pytest.mark.parametrize("bad", [dict(lr=0), dict(dtype="fp16"), dict(zero_stage=3),
                                 dict(dtype="bf16", zero_stage=0), dict(min_lr=1.0),
                                 dict(warmup_ratio=1.0), dict(device="tpu"),
                                 dict(export_dtype="int8"), dict(micro_batch_size=0)])
def test_unsupported_settings_are_refused(bad):
    with pytest.raises(ValueError):
        TrainConfig(**bad)


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    total, warmup = 200, 3
    f = [lr_factor(s, warmup=warmup, total=total, min_ratio=0.1) for s in range(total + 1)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert f[3] == pytest.approx(1.0) and f[total] == pytest.approx(0.1)
    mid = warmup + (total - warmup) // 2
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), abs=0.01)
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))
    assert warmup_steps(TrainConfig(), 200) == 3  # ceil(1.5%)
    assert lr_factor(0, warmup=0, total=10, min_ratio=0.0) == pytest.approx(1.0)


def test_steps_per_epoch_use_the_global_batch_and_drop_the_tail():
    c = TrainConfig(micro_batch_size=4, grad_accum=2, world_size=2, epochs=3)
    assert c.samples_per_step == 16
    assert total_steps(c, 100) == (6, 18)
    assert total_steps(TrainConfig(micro_batch_size=4, max_steps=50), 100) == (25, 50)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        total_steps(c, 15)


def test_deepspeed_config_carries_batching_clipping_precision_and_zero():
    c = TrainConfig(micro_batch_size=3, grad_accum=2, world_size=2, zero_stage=1, dtype="bf16")
    ds = deepspeed_config(c)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["train_batch_size"]) == (3, 2, 12)
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"]["stage"] == 1
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert "optimizer" not in ds and "scheduler" not in ds  # torch objects are passed in
    assert deepspeed_config(TrainConfig(zero_stage=0))["zero_optimization"] == {"stage": 0}


def test_fingerprint_ignores_bookkeeping_but_not_learning():
    base = TrainConfig()
    assert TrainConfig(log_every=1, checkpoint_every=3).fingerprint() == base.fingerprint()
    assert TrainConfig(lr=2e-4).fingerprint() != base.fingerprint()
    assert from_dict(TrainConfig, to_dict(base)) == base
    with pytest.raises(ValueError, match="unknown"):
        from_dict(TrainConfig, {"learning_rate": 1.0})


def test_dagster_run_config_and_resource_mirror_the_core_config():
    core = {f.name for f in fields(TrainConfig)}
    run = set(DrafterRunConfig.model_fields) - {"warm_start"}
    assert run | set(EXECUTION_FIELDS) == core and not run & set(EXECUTION_FIELDS)
    assert DrafterRunConfig().to_core() == TrainConfig()
    assert set(EXECUTION_FIELDS) <= set(TrainerResource.model_fields)
    applied = TrainerResource(world_size=2, zero_stage=1, dtype="auto", device="cpu",
                              threads=3).apply(TrainConfig())
    assert (applied.world_size, applied.zero_stage, applied.dtype, applied.device,
            applied.threads) == (2, 1, "fp32", "cpu", 3)
