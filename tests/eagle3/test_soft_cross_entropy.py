"""The soft cross-entropy of the TTT loss: its value and its hand-written backward."""

from __future__ import annotations

import pytest
import torch

from pipeline.eagle3.ttt import soft_cross_entropy


def targets(shape, generator, dtype=torch.float64) -> torch.Tensor:
    return torch.softmax(3.0 * torch.randn(shape, generator=generator, dtype=dtype), dim=-1)


def test_value_and_gradient_equal_autograd_of_the_definition():
    g = torch.Generator().manual_seed(0)
    x = (4.0 * torch.randn(9, 37, generator=g, dtype=torch.float64)).requires_grad_()
    p = targets((9, 37), g)
    upstream = torch.randn(9, generator=g, dtype=torch.float64)
    fast = soft_cross_entropy(x, p)
    (fast_grad,) = torch.autograd.grad((fast * upstream).sum(), x)
    slow = -(p * torch.log_softmax(x, dim=-1)).sum(-1)
    (slow_grad,) = torch.autograd.grad((slow * upstream).sum(), x)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast_grad, slow_grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda y: soft_cross_entropy(y, p), (x,))


def test_fp32_gradient_is_close_and_target_gets_none():
    g = torch.Generator().manual_seed(1)
    x = (4.0 * torch.randn(5, 300, generator=g)).requires_grad_()
    p = targets((5, 300), g, torch.float32)
    soft_cross_entropy(x, p).sum().backward()
    ref = torch.softmax(x.detach().double(), -1) - p.double()
    torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="must not require grad"):
        soft_cross_entropy(x, p.clone().requires_grad_())
