"""The held-out split: by prompt, deterministic, salted, with the requested share."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.capture.heldout import HeldoutSplit, prompt_of


def test_prompt_is_the_tokens_before_the_first_trained_one():
    ids = np.array([5, 6, 7, 8, 9])
    assert prompt_of(ids, np.array([0, 0, 1, 0, 1])).tolist() == [5, 6]
    assert prompt_of(ids, np.zeros(5)).tolist() == [5, 6, 7, 8, 9]
    assert prompt_of(ids, np.ones(5)).tolist() == []


def test_split_depends_on_the_prompt_only_and_hits_the_fraction():
    rng = np.random.default_rng(0)
    split = HeldoutSplit(0.2)
    held = 0
    for _ in range(4000):
        prompt = rng.integers(0, 50_000, rng.integers(1, 30))
        a = np.concatenate([prompt, rng.integers(0, 50_000, 5)])
        b = np.concatenate([prompt, rng.integers(0, 50_000, 9)])
        mask_a = np.r_[np.zeros(len(prompt)), np.ones(5)]
        mask_b = np.r_[np.zeros(len(prompt)), np.ones(9)]
        side = split.holds_out(a, mask_a)
        assert side == split.holds_out(b, mask_b)  # siblings land together
        held += side
    assert held / 4000 == pytest.approx(0.2, abs=0.025)


def test_salt_and_fraction_change_the_split():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1000, 8) for _ in range(400)]
    mask = np.zeros(8)

    def side(split):
        return [split.holds_out(p, mask) for p in prompts]

    assert side(HeldoutSplit(0.5)) != side(HeldoutSplit(0.5, salt="other"))
    assert not any(side(HeldoutSplit(0.0))) and all(side(HeldoutSplit(1.0)))
    small, large = side(HeldoutSplit(0.1)), side(HeldoutSplit(0.4))
    assert all(b for a, b in zip(small, large, strict=True) if a)  # nested


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_is_validated(fraction):
    with pytest.raises(ValueError, match="fraction"):
        HeldoutSplit(fraction)
