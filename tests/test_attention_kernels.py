"""Aerie's forward passes attend without cuDNN's per-shape graphs (pipeline.attention_kernels):
every attention call of capture, TTT training and evaluation runs with cuDNN attention
disabled, and the backends enabled before are restored afterwards. On a CPU this is what
can be checked: the flags each call runs under (the kernel choice itself happens on CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from pipeline.attention_kernels import shape_stable
from pipeline.capture.hf import HFCaptureBackend
from pipeline.eagle3.spec import SpecParams
from pipeline.eagle3.ttt import ttt_loss
from pipeline.evaluation.engine import evaluate
from pipeline.evaluation.reference import greedy_reference, is_near_tie
from tests.eagle3.helpers import random_batch, tiny_drafter, tiny_target_config


@pytest.fixture
def calls(monkeypatch) -> list[bool]:
    """Whether cuDNN attention was enabled at each attention call made while the test runs."""
    seen: list[bool] = []
    original = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


@pytest.fixture
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


def test_shape_stable_turns_cudnn_off_and_restores_the_flags():
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with shape_stable():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_training_attends_without_cudnn(calls):
    model = tiny_drafter()
    loss, _ = ttt_loss(model, random_batch(model, [9, 14, 5]), depth=3)
    loss.backward()
    assert calls and not any(calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_evaluation_attends_without_cudnn(calls, target):
    drafter = tiny_drafter(target=target.config)
    prompts = [[3, 7, 1, 9], [5, 2, 8]]
    evaluate(target, drafter, prompts, SpecParams(3, 2, 4), max_new_tokens=6)
    reference = greedy_reference(target, prompts[0], 6)
    is_near_tie(target, prompts[0], reference, [*reference[:2], 0], tolerance=0.5)
    assert calls and not any(calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_capture_attends_without_cudnn(calls, target):
    HFCaptureBackend(target).capture([[3, 7, 1, 9], [5, 2]])
    assert calls and not any(calls)
