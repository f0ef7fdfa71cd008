"""Speculative sampling: verifying a draft tree at temperature > 0, as SGLang's EAGLE worker.

SGLang (``docs/speculative-sampling.md`` has the facts and where they are in its source)
verifies at temperature > 0 with sgl-kernel's ``tree_speculative_sampling_target_only``.
Its walk, for one sequence, with the default thresholds (``speculative_accept_threshold_
single = _acc = 1.0``):

1. ``q`` = the target's sampling distribution at every tree node (:func:`target_probs`:
   logits / temperature, softmax, then top-k and top-p, each renormalised; SGLang's
   verification applies no min-p, so neither does this).
2. From the root, with one uniform draw ``u`` per expanded node: walk the node's children
   in order, summing ``q(child token)``; the first child whose running sum passes ``u``
   is accepted and the walk moves to it (a fresh ``u``). This is inverse-CDF sampling of
   ``q`` with the children listed first: a child is accepted with exactly its ``q``.
3. If no child is accepted (or the node is a leaf), one more token is drawn from ``q`` at
   the last accepted node with the children that were tried removed and the rest
   renormalised (the *residual*): the bonus (or correction) token.

The draft probabilities play no part ("target only"), so every token emitted is an exact
sample of the target's own distribution given what precedes it: lossless in distribution
for any drafter (``tests/evaluation/test_speculative_sampling.py`` checks it
statistically). Greedy (temperature 0) stays the argmax walk of :mod:`.tree`.

Every draw comes from a caller's :class:`torch.Generator`: a fixed seed gives identical
tokens and counts. A cycle draws ``len(tree) + 1`` uniforms (one per node, then the one for
the residual), like SGLang's ``coins`` and ``coins_for_final_sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.evaluation.tree import VerifyTree, accept_greedy
from pipeline.sampling import SamplingParams


@dataclass(frozen=True)
class Verdict:
    """A verified cycle: accepted nodes (root first), draft positions judged, next token."""

    path: list[int]
    attempted: int
    bonus: int


def first_token(logits: torch.Tensor, sampler: SamplingParams,
                generator: torch.Generator | None) -> int:
    """The prefill's token from its (V,) logits: the argmax, or one draw. SGLang samples it
    with its ordinary sampler, which applies min-p (verification does not)."""
    if sampler.greedy:
        return int(logits.argmax())
    probs = target_probs(logits[None], sampler)[0]  # (V,)
    if sampler.min_p > 0:
        probs = probs.masked_fill(probs < sampler.min_p * probs.max(), 0.0)
    return draw(probs, uniforms(1, generator)[0])


def judge(tree: VerifyTree, logits: torch.Tensor, sampler: SamplingParams,
          generator: torch.Generator | None) -> Verdict:
    """Verify ``tree`` from the target's (N, V) logits at its nodes: the greedy walk
    (:func:`~.tree.accept_greedy`, bonus = the argmax after the last accepted node) or
    speculative sampling (:func:`accept_sampled`)."""
    if sampler.greedy:
        preds = logits.argmax(-1).cpu()  # (N,)
        path, attempted = accept_greedy(tree, preds)
        return Verdict(path, attempted, int(preds[path[-1]]))
    probs = target_probs(logits, sampler)
    return accept_sampled(tree, probs, uniforms(len(tree) + 1, generator))


def target_probs(logits: torch.Tensor, sampler: SamplingParams) -> torch.Tensor:
    """(N, V) logits -> (N, V) fp32 sampling distributions (temperature > 0), as SGLang's
    ``eagle_sample`` builds them: temperature, top-k, top-p; ``min_p`` is not applied."""
    if sampler.greedy:
        raise ValueError("greedy decoding has no sampling distribution; take the argmax")
    probs = torch.softmax(logits.float() / sampler.temperature, dim=-1)  # (N, V)
    if sampler.top_k != -1 and sampler.top_k < probs.shape[-1]:
        kth = torch.topk(probs, sampler.top_k, dim=-1).values[..., -1:]  # (N, 1)
        probs = _renorm(probs.masked_fill(probs < kth, 0.0))
    if sampler.top_p < 1:
        probs = _renorm(probs.masked_fill(~top_p_mask(probs, sampler.top_p), 0.0))
    return probs


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(N, V) bool: the most likely tokens until their mass reaches ``top_p`` (the token
    that crosses it included)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass ranked above each token
    keep_sorted = before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _renorm(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def uniforms(count: int, generator: torch.Generator | None) -> list[float]:
    return torch.rand(count, generator=generator, dtype=torch.float64).tolist()


def accept_sampled(tree: VerifyTree, probs: torch.Tensor, coins: list[float]) -> Verdict:
    """Speculative sampling over ``tree`` (module docstring): ``probs`` (N, V) the target's
    sampling distribution at every node, ``coins`` ``len(tree) + 1`` uniforms in [0, 1)."""
    if len(coins) != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} uniforms for a {len(tree)}-node tree, got "
                         f"{len(coins)}")
    tokens, kids = tree.tokens.tolist(), tree.children()
    path, attempted, node, tried = [0], 0, 0, []
    while kids[node]:
        attempted += 1
        child_tokens = [tokens[c] for c in kids[node]]
        child_probs = probs[node, child_tokens].tolist()
        chosen = first_accepted(child_probs, coins[node])
        if chosen is None:
            tried = child_tokens
            break
        node = kids[node][chosen]
        path.append(node)
    bonus = draw(residual(probs[node], tried), coins[-1])
    return Verdict(path, attempted, bonus)


def first_accepted(child_probs: list[float], coin: float) -> int | None:
    """The first child whose running sum of target probabilities passes ``coin`` (SGLang
    tests ``coin <= sum``; ``<`` differs only when ``coin`` equals a sum exactly, and keeps
    a token of probability 0 from ever being accepted)."""
    total = 0.0
    for i, p in enumerate(child_probs):
        total += p
        if coin < total:
            return i
    return None


def residual(probs: torch.Tensor, tried: list[int]) -> torch.Tensor:
    """(V,) ``probs`` without the rejected children's tokens (unnormalised: see draw).
    When rounding left them all the mass, the row itself."""
    if not tried:
        return probs
    rest = probs.clone()
    rest[tried] = 0.0
    return rest if float(rest.sum()) > 0 else probs


def draw(weights: torch.Tensor, coin: float) -> int:
    """Inverse-CDF draw from non-negative (V,) ``weights`` scaled to their total."""
    cdf = torch.cumsum(weights.double(), dim=0)
    index = int(torch.searchsorted(cdf, coin * float(cdf[-1]), right=True))
    return min(index, weights.shape[0] - 1)
