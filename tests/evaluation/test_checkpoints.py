"""The path an asset takes: an HF target checkpoint dir and an SGLang drafter dir on disk."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.eagle3.export import load_drafter, save_drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine import evaluate
from tests.evaluation.conftest import expected

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory, target, drafter):
    root = tmp_path_factory.mktemp("checkpoints")
    target.save_pretrained(root / "target")
    save_drafter(drafter, drafter.config, root / "drafter32", dtype=torch.float32)
    save_drafter(drafter, drafter.config, root / "drafter16")  # bf16, the default
    return root


def test_loaded_checkpoints_match_in_memory_models(on_disk, target, drafter, prompts,
                                                   references):
    loaded = AutoModelForCausalLM.from_pretrained(on_disk / "target", dtype=torch.float32)
    loaded_drafter = load_drafter(on_disk / "drafter32", loaded.model.embed_tokens)
    params = SpecParams.auto_for(loaded.config.architectures)
    assert params == SpecParams(5, 4, 8)
    stats, outputs = evaluate(loaded, loaded_drafter, prompts[:6], params, max_new_tokens=12)
    assert outputs == expected(references[:6], 12)
    same, _ = evaluate(target, drafter, prompts[:6], params, max_new_tokens=12)
    assert stats.counts() == same.counts()


def test_bf16_drafter_on_fp32_target_stays_lossless(on_disk, target, prompts, references):
    drafter16 = load_drafter(on_disk / "drafter16", target.model.embed_tokens)
    assert drafter16.dtype == torch.bfloat16
    stats, outputs = evaluate(target, drafter16, prompts[:6], SpecParams(3, 2, 6),
                              max_new_tokens=12)
    assert outputs == expected(references[:6], 12)
    assert stats.cycles > 0


def test_params_default_to_sglang_auto_choice(target, drafter, prompts):
    stats, _ = evaluate(target, drafter, prompts[:2], max_new_tokens=4)
    assert stats.num_steps == 5  # LlamaForCausalLM -> (5, 4, 8)


def test_bad_arguments(target, drafter, prompts):
    with pytest.raises(ValueError, match="max_new_tokens"):
        evaluate(target, drafter, prompts[:1], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        evaluate(target, drafter, [[]], max_new_tokens=3)
    with pytest.raises(TypeError, match="Drafter"):
        evaluate(target, object(), prompts[:1], max_new_tokens=3)


def test_modes_are_restored(target, drafter, prompts):
    target.train()
    try:
        evaluate(target, drafter, prompts[:1], SpecParams(2, 1, 3), max_new_tokens=3)
        assert target.training and not drafter.training
    finally:
        target.eval()
