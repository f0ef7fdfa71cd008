"""Greedy speculative decoding emits exactly the target's greedy decoding, token for token,
whatever the drafter proposes; and the comparison catches a broken mask, position or cache."""

from __future__ import annotations

import pytest
import torch

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine import evaluate
from pipeline.evaluation.target import TargetRunner
from pipeline.evaluation.tree import VerifyTree
from tests.evaluation.conftest import MAX_NEW, VOCAB, expected
from tests.evaluation.synthetic import OracleDrafter, RandomDrafter, context_seed

pytestmark = pytest.mark.integration


def mixed_rank(context, position):
    """The greedy token first (3/6), second (1/6), third (1/6) or absent (1/6): acceptance
    lengths of every size, accepted paths through first and later children."""
    return [0, 0, 0, 1, 2, None][context_seed(position, context) % 6]


def make(kind: str, target, drafter, dflash=None):
    return {"random": lambda: RandomDrafter(VOCAB, seed=3),
            "oracle": lambda: OracleDrafter(target),
            "mixed": lambda: OracleDrafter(target, top_prob=0.6, greedy_rank=mixed_rank),
            "eagle": lambda: drafter,
            "dflash": lambda: dflash,
            "none": lambda: None}[kind]()


CASES = [
    ("none", None),
    ("random", SpecParams(5, 1, 6)), ("random", SpecParams(4, 4, 8)),
    ("oracle", SpecParams(5, 1, 6)), ("oracle", SpecParams(3, 2, 6)),
    ("mixed", SpecParams(4, 1, 5)), ("mixed", SpecParams(4, 2, 7)),
    ("mixed", SpecParams(5, 4, 8)), ("mixed", SpecParams(2, 4, 16)),
    ("eagle", SpecParams(5, 1, 6)), ("eagle", SpecParams(3, 2, 4)),
    ("eagle", SpecParams(5, 4, 8)),
    ("dflash", SpecParams(7, 1, 8)), ("dflash", SpecParams(3, 1, 4)),
]


@pytest.mark.parametrize("kind, params", CASES, ids=lambda c: str(c))
def test_lossless(kind, params, target, drafter, dflash, prompts, references):
    stats, outputs = evaluate(target, make(kind, target, drafter, dflash), prompts, params,
                              max_new_tokens=MAX_NEW)
    assert outputs == expected(references, MAX_NEW)
    assert stats.generated_tokens == sum(map(len, outputs)) == len(prompts) * MAX_NEW
    assert stats.prompts == len(prompts)


def eos_ids(references) -> set[int]:
    """A token some prompt emits 4th (not earlier), and one another prompt emits first."""
    fourth = next(r[3] for r in references if r[3] not in r[:3])
    first = next(r[0] for r in references if r[0] != fourth)
    return {fourth, first}


@pytest.mark.parametrize("kind, params", [("mixed", SpecParams(5, 1, 6)),
                                          ("mixed", SpecParams(5, 4, 8)),
                                          ("eagle", SpecParams(4, 2, 6)),
                                          ("dflash", SpecParams(5, 1, 6)), ("none", None)],
                         ids=str)
def test_stops_at_eos(kind, params, target, drafter, dflash, prompts, references):
    eos = eos_ids(references)
    stats, outputs = evaluate(target, make(kind, target, drafter, dflash), prompts, params,
                              max_new_tokens=MAX_NEW, eos_token_id=eos)
    want = expected(references, MAX_NEW, eos)
    assert outputs == want
    assert any(len(o) == 1 for o in want) and any(1 < len(o) < MAX_NEW for o in want)
    assert stats.generated_tokens == sum(map(len, outputs))


@pytest.mark.parametrize("max_new", [1, 2, 3, 17])
@pytest.mark.parametrize("kind, params", [("oracle", SpecParams(5, 1, 6)),
                                          ("mixed", SpecParams(5, 4, 8)),
                                          ("eagle", SpecParams(5, 1, 6))], ids=str)
def test_max_new_tokens(max_new, kind, params, target, drafter, prompts, references):
    stats, outputs = evaluate(target, make(kind, target, drafter), prompts[:8], params,
                              max_new_tokens=max_new)
    assert outputs == expected(references[:8], max_new)
    assert stats.generated_tokens == 8 * max_new


def test_oracle_truncated_last_cycle_counts_only_what_it_emitted(target, prompts):
    """16 tokens after the prefill with cycles of 6: 6 + 6 + 4, the last without its bonus."""
    stats, _ = evaluate(target, OracleDrafter(target), prompts[:1], SpecParams(5, 1, 6),
                        max_new_tokens=17)
    assert stats.cycles == 3 and stats.emitted_tokens == 16 and stats.bonus_tokens == 2
    assert stats.accept_hist == [0, 0, 0, 0, 1, 2]
    assert stats.position_attempts == [3, 3, 3, 3, 2]


# -- the comparison can fail: break the engine on purpose ------------------------------
def _causal_mask(self: VerifyTree) -> torch.Tensor:
    return torch.ones(len(self), len(self), dtype=torch.bool).tril()


def _no_pruning(self, prefix, tree_nodes) -> None:
    pass


def _chain_positions(verify):
    def wrapped(self, tokens, depths, ancestors):
        return verify(self, tokens, torch.arange(len(tokens)), ancestors)
    return wrapped


@pytest.mark.parametrize("breakage", ["causal mask over the tree", "rejected KV kept",
                                      "positions by index, not depth"])
def test_broken_engines_are_caught(breakage, monkeypatch, target, prompts, references):
    if breakage == "causal mask over the tree":
        monkeypatch.setattr(VerifyTree, "ancestor_mask", _causal_mask)
    elif breakage == "rejected KV kept":
        monkeypatch.setattr(TargetRunner, "keep", _no_pruning)
    else:
        monkeypatch.setattr(TargetRunner, "verify", _chain_positions(TargetRunner.verify))
    drafter = OracleDrafter(target, top_prob=0.6, greedy_rank=mixed_rank)
    _, outputs = evaluate(target, drafter, prompts[:6], SpecParams(5, 4, 8),
                          max_new_tokens=16)
    assert outputs != expected(references[:6], 16)
