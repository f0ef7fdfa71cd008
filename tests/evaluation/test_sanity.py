"""Acceptance numbers the engine must get exactly right with drafters of known quality."""

from __future__ import annotations

import math

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine import evaluate
from tests.evaluation.conftest import VOCAB
from tests.evaluation.synthetic import OracleDrafter, RandomDrafter

pytestmark = pytest.mark.integration

# 1 prefill token + whole cycles: no truncation (and no EOS) interferes with tau
CHAIN5 = SpecParams(5, 1, 6)


def test_baseline_is_plain_greedy_with_tau_one(target, prompts):
    stats, outputs = evaluate(target, None, prompts[:5], max_new_tokens=12)
    assert stats.num_steps == 0 and stats.tau == 1.0 and stats.alpha == []
    assert stats.cycles == 5 * 11 and stats.draft_seconds == 0.0


@pytest.mark.parametrize("params", [CHAIN5, SpecParams(3, 1, 4), SpecParams(5, 4, 8),
                                    SpecParams(3, 2, 6), SpecParams(4, 4, 4)], ids=str)
def test_oracle_is_fully_accepted(params, target, prompts):
    depth = min(params.num_steps, params.num_draft_tokens - 1)  # drafts on the best path
    cycles = 3
    stats, _ = evaluate(target, OracleDrafter(target), prompts[:4], params,
                        max_new_tokens=1 + cycles * (depth + 1))
    assert stats.tau == depth + 1
    assert stats.cycles == 4 * cycles and stats.accept_hist[depth] == stats.cycles
    assert stats.alpha[:depth] == [1.0] * depth


@pytest.mark.parametrize("params", [CHAIN5, SpecParams(5, 4, 8)], ids=str)
def test_random_drafter_is_almost_never_accepted(params, target, prompts):
    stats, _ = evaluate(target, RandomDrafter(VOCAB, seed=5), prompts, params,
                        max_new_tokens=16)
    assert 1.0 <= stats.tau < 1.2
    assert stats.alpha[0] < 0.2


@pytest.mark.parametrize("k", [0, 2, 4])
def test_drafter_right_up_to_position_k(k, target, prompts):
    """Right at draft positions < k, wrong at k: every cycle accepts exactly k drafts."""
    drafter = OracleDrafter(target, greedy_rank=lambda _c, pos: None if pos == k else 0)
    stats, _ = evaluate(target, drafter, prompts[:4], CHAIN5, max_new_tokens=1 + 3 * (k + 1))
    assert stats.cycles == 12 and stats.accept_hist[k] == 12 and stats.tau == k + 1
    assert stats.alpha[:k] == [1.0] * k and stats.alpha[k] == 0.0
    assert all(math.isnan(a) for a in stats.alpha[k + 1:])
    assert stats.position_attempts[k + 1:] == [0] * (4 - k)


def test_second_choice_is_accepted_by_a_tree_not_by_a_chain(target, prompts):
    """Greedy token always ranked second (p .55 / .45): a chain never accepts it; a topk-2
    tree verifies the runner-up at depth 1 (.45 beats everything at depth 2) and accepts it,
    but drops the runner-up's runner-up (.2025) from the depth-2 frontier."""
    drafter = OracleDrafter(target, top_prob=0.55, greedy_rank=lambda _c, _p: 1)
    chain, _ = evaluate(target, drafter, prompts[:4], SpecParams(3, 1, 4), max_new_tokens=9)
    trace = []
    tree, _ = evaluate(target, drafter, prompts[:4], SpecParams(3, 2, 4), max_new_tokens=9,
                       trace=trace)
    assert chain.tau == 1.0 and chain.accept_hist[0] == chain.cycles
    assert tree.tau == 2.0 and tree.accept_hist[1] == tree.cycles
    # verified: root, its two children (node 2 = the runner-up) and the favourite's favourite
    assert all(c.tree.parents.tolist() == [-1, 0, 0, 1] and c.path == [0, 2] for c in trace)


def test_stats_do_not_depend_on_grouping(target, drafter, prompts):
    params = SpecParams(4, 2, 6)
    whole, outputs = evaluate(target, drafter, prompts[:9], params, max_new_tokens=10)
    first, out_a = evaluate(target, drafter, prompts[:4], params, max_new_tokens=10)
    second, out_b = evaluate(target, drafter, prompts[4:9], params, max_new_tokens=10)
    assert first.merge(second).counts() == whole.counts()
    assert out_a + out_b == outputs
