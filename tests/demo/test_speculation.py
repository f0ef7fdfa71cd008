"""The demo trainer's counters describe the rollout they are attached to: its engine's
sample is cut at the rollout's own length, as ``max_new_tokens`` of that length would."""

from __future__ import annotations

import random

from pipeline.demo.speculation import capped_counts


def test_an_uncut_sample_keeps_every_pass_and_token():
    assert capped_counts([3, 1, 4], 9, limit=100) == (3, 9)  # prefill + 8 from 3 passes
    assert capped_counts([3, 1, 4], 7, limit=100) == (3, 7)  # an end token cut the last


def test_a_cut_sample_counts_the_passes_that_emitted_its_tokens():
    assert capped_counts([3, 1, 4], 9, limit=4) == (1, 4)  # the first pass emits 3
    assert capped_counts([3, 1, 4], 9, limit=5) == (2, 5)
    assert capped_counts([3, 1, 4], 9, limit=6) == (3, 6)  # the third pass cut short
    assert capped_counts([3, 1, 4], 9, limit=1) == (0, 1)  # the prefill token only


def test_cut_counts_keep_the_record_contract():
    """Whatever the passes and the rollout's length: at least one token per pass after the
    prefill token, at most what the rollout holds, and at most what the passes emitted."""
    rng = random.Random(0)
    for _ in range(500):
        passes = [rng.randint(1, 5) for _ in range(rng.randint(0, 30))]
        generated = 1 + sum(passes) - (rng.randint(0, passes[-1] - 1) if passes else 0)
        limit = rng.randint(1, 200)
        verify, completion = capped_counts(passes, generated, limit)
        assert completion <= limit and completion <= generated
        assert verify == 0 or completion >= verify + 1
        assert completion - 1 <= sum(passes[:verify])
