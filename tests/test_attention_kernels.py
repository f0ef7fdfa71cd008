"""Aerie's forward passes attend without cuDNN's per-shape graphs (pipeline.attention_kernels):
every attention call of capture, TTT training and evaluation runs with cuDNN attention
disabled, and the backends enabled before are restored afterwards. On a CPU this is what
can be checked: the flags each call runs under (the kernel choice itself happens on CUDA).
"""

from __future__ import annotations

import threading

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


@pytest.fixture(autouse=True)
def cudnn_enabled():
    """Each test starts with cuDNN attention enabled (PyTorch's default) and leaves the flag
    as it found it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


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


def test_shape_stable_turns_cudnn_off_only_and_restores_it():
    torch.backends.cuda.enable_flash_sdp(False)  # a user's own choice stays as it is
    try:
        with shape_stable():
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.mem_efficient_sdp_enabled()
            with shape_stable():  # nested
                assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_blocks_on_two_threads_restore_the_flag_whatever_order_they_leave_in():
    """A enters, B enters, A leaves, B leaves: cuDNN stays off until B leaves, then is on
    again (a save-and-restore per block would leave it off)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with shape_stable():
            a_in.set()
            b_in.wait()
        a_out.set()

    def b():
        a_in.wait()
        with shape_stable():
            b_in.set()
            a_out.wait()
            seen["after A left"] = torch.backends.cuda.cudnn_sdp_enabled()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"after A left": False}
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
    assert torch.backends.cuda.cudnn_sdp_enabled()
