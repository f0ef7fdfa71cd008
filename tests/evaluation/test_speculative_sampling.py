"""Speculative sampling is lossless in distribution, and this test catches it when it is not.

A tiny world with exact answers: a target over a 4-token vocabulary whose next-token logits
depend on the last two tokens (a fixed random table), and a drafter that proposes from a
perturbed copy of that table. The engine's own ``generate`` decodes the first three tokens
after a fixed prompt thousands of times with different seeds, with a chain and with a tree
drafter, so the emitted tokens come from accepted drafts, residual draws after rejections
and bonus tokens alike. Their empirical distribution (64 sequences) is compared by a
chi-square test with the exact distribution of plain sampling, computed from the table by
this file's own reference sampler (not the engine's). Then the same test runs with a bug
planted in the engine and must fail: a residual that keeps the rejected tokens, a residual
drawn without renormalisation, top-p applied before the temperature, and a sibling walk off
by one.

Seeded, so every run is identical; the significance level (1e-4) leaves the correct engine
far inside (p-values are printed on failure) and every planted bug far outside.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation import sampling
from pipeline.evaluation.engine import generate
from pipeline.sampling import SamplingParams

from .synthetic import _ContextDrafter

pytestmark = pytest.mark.integration

V, LENGTH, RUNS, ALPHA = 4, 3, 3000, 1e-4
PROMPT = [0, 1]
TABLE = torch.randn(V, V, V, generator=torch.Generator().manual_seed(7)) * 1.5  # (a, b) -> V
DRAFT_TABLE = TABLE + torch.randn(V, V, V, generator=torch.Generator().manual_seed(8))
DRAFT_PROBS = torch.softmax(DRAFT_TABLE, dim=-1)  # (a, b) -> V
CHAIN = SpecParams(num_steps=2, eagle_topk=1, num_draft_tokens=3)
TREE = SpecParams(num_steps=2, eagle_topk=2, num_draft_tokens=4)
SAMPLERS = {"T=1": SamplingParams(1.0), "T=0.7 top_p=0.8": SamplingParams(0.7, top_p=0.8),
            # min_p: applied to the prefill's token only, as SGLang
            "T=1.3 top_k=3 min_p=0.1": SamplingParams(1.3, top_k=3, min_p=0.1)}


def logits_after(context: list[int]) -> torch.Tensor:
    return TABLE[context[-2], context[-1]]


class TableTarget:
    """The :class:`~pipeline.evaluation.target.TargetRunner` interface over the table: a
    "cache" of verified tokens, tree nodes verified against their own ancestors."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.pending: list[int] = []

    @property
    def length(self) -> int:
        return len(self.seq)

    def check_length(self, length: int) -> None:
        pass

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.seq = prompt.tolist()
        return logits_after(self.seq), None

    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor
               ) -> tuple[torch.Tensor, None]:
        self.pending = tokens.tolist()
        rows = []
        for row in ancestors.tolist():  # node i's ancestors (node i last) precede it
            path = [token for token, on_path in zip(self.pending, row, strict=True) if on_path]
            rows.append(logits_after(self.seq + path))
        return torch.stack(rows), None

    def keep(self, prefix: int, tree_nodes: list[int]) -> None:
        self.seq = self.seq[:prefix] + [self.pending[i] for i in tree_nodes]


class TableDrafter(_ContextDrafter):
    """Proposes the top-k tokens of the perturbed table, with their draft probabilities."""

    def choose(self, contexts, positions, k):
        probs = DRAFT_PROBS[[c[-2] for c in contexts], [c[-1] for c in contexts]]  # (F, V)
        top = torch.topk(probs, k, dim=-1)
        return top.values, top.indices


def reference_distribution(sampler: SamplingParams, logits: torch.Tensor,
                           min_p: bool = False) -> list[float]:
    """Plain sampling's next-token distribution as SGLang defines it, written independently
    of the engine: temperature, then top-k and top-p on a sorted list, each renormalised;
    min-p only for the prefill's token (``min_p``), which SGLang's ordinary sampler draws:
    its speculative verification applies none."""
    probs = [math.exp(x / sampler.temperature) for x in logits.tolist()]
    ranked = sorted(range(V), key=lambda t: -probs[t])
    keep = set(ranked[:sampler.top_k] if sampler.top_k > 0 else ranked)
    total = sum(probs[t] for t in keep)
    mass, kept = 0.0, set()
    for t in ranked:
        if t in keep and mass < sampler.top_p:
            kept.add(t)
            mass += probs[t] / total
    if min_p:
        top = max(probs[t] for t in kept)
        kept = {t for t in kept if probs[t] >= sampler.min_p * top}
    total = sum(probs[t] for t in kept)
    return [probs[t] / total if t in kept else 0.0 for t in range(V)]


def exact_sequences(sampler: SamplingParams) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        p, context = 1.0, list(PROMPT)
        for i, token in enumerate(seq):
            p *= reference_distribution(sampler, logits_after(context), min_p=i == 0)[token]
            context.append(token)
        out[seq] = p
    return out


def sampled_sequences(sampler: SamplingParams, params: SpecParams | None
                      ) -> tuple[Counter, int]:
    """(counts of the first LENGTH tokens over RUNS seeded decodings, cycles with a reject);
    under ``torch.inference_mode()``, as ``generate`` asks (and a quarter faster)"""
    counts: Counter = Counter()
    drafter = TableDrafter() if params is not None else None
    rejected = 0
    with torch.inference_mode():
        for seed in range(RUNS):
            out, stats = generate(TableTarget(), drafter, PROMPT, params, LENGTH, frozenset(),
                                  sampler=sampler,
                                  generator=torch.Generator().manual_seed(seed))
            counts[tuple(out)] += 1
            rejected += stats.cycles - stats.accept_hist[-1]
    return counts, rejected


def p_value(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; sequences expected fewer than 5 times pooled, and any
    sequence the target cannot produce fails outright."""
    impossible = sum(n for seq, n in counts.items() if exact.get(seq, 0.0) == 0.0)
    if impossible:
        return 0.0
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for seq, p in exact.items():
        if p * RUNS < 5:
            pooled_o, pooled_e = pooled_o + counts[seq], pooled_e + p * RUNS
        elif p > 0:
            observed.append(counts[seq])
            expected.append(p * RUNS)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    return float(chisquare(observed, [e * sum(observed) / sum(expected) for e in expected])
                 .pvalue)


@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
@pytest.mark.parametrize("shape", ["chain", "tree", "no drafter"])
def test_emitted_tokens_follow_the_targets_sampling_distribution(sampler_name, shape):
    sampler = SAMPLERS[sampler_name]
    params = {"chain": CHAIN, "tree": TREE, "no drafter": None}[shape]
    counts, rejected = sampled_sequences(sampler, params)
    if params is not None:
        assert rejected > RUNS // 10  # the residual draw after a rejection is exercised
    p = p_value(counts, exact_sequences(sampler))
    assert p > ALPHA, f"{shape} at {sampler_name}: p = {p:.2e}"


def _residual_keeps_rejected(probs, tried):
    return probs


def _draw_unnormalised(weights, coin):
    cdf = torch.cumsum(weights.double(), dim=0)
    return min(int(torch.searchsorted(cdf, coin, right=True)), weights.shape[0] - 1)


def _top_p_before_temperature(logits, sampler):
    plain = torch.softmax(logits.float(), dim=-1)
    masked = logits.float().masked_fill(~sampling.top_p_mask(plain, sampler.top_p),
                                        -math.inf)
    return torch.softmax(masked / sampler.temperature, dim=-1)


def _walk_off_by_one(child_probs, coin):
    total = 0.0
    for i, p in enumerate(child_probs):
        if coin < total:
            return i
        total += p
    return None


PLANTED = {
    "residual keeps the rejected tokens": ("residual", _residual_keeps_rejected, "T=1"),
    "residual not renormalised": ("draw", _draw_unnormalised, "T=1"),
    "top-p before the temperature": ("target_probs", _top_p_before_temperature,
                                     "T=0.7 top_p=0.8"),
    "sibling walk off by one": ("first_accepted", _walk_off_by_one, "T=1"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_each_planted_bug_fails_the_test(monkeypatch, bug, shape):
    name, planted, sampler_name = PLANTED[bug]
    monkeypatch.setattr(sampling, name, planted)
    sampler = SAMPLERS[sampler_name]
    counts, _ = sampled_sequences(sampler, CHAIN if shape == "chain" else TREE)
    p = p_value(counts, exact_sequences(sampler))
    assert p < ALPHA, f"{bug} ({shape}) went unnoticed: p = {p:.2e}"


def test_a_fixed_seed_repeats_tokens_and_counts_and_another_differs():
    sampler = SAMPLERS["T=1"]

    def once(seed: int):
        return generate(TableTarget(), TableDrafter(), PROMPT, TREE, 24, frozenset(),
                        sampler=sampler, generator=torch.Generator().manual_seed(seed))

    (out_a, stats_a), (out_b, stats_b), (out_c, _) = once(5), once(5), once(6)
    assert out_a == out_b and stats_a.counts() == stats_b.counts()
    assert out_a != out_c
