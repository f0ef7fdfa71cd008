"""Drafters with known behaviour, to check the engine (and its metrics) end to end.

They read no features: they see the verified tokens (``reset`` + ``extend``) and, for each
frontier node, the draft path to it, and propose from that context alone.

- :class:`OracleDrafter` asks the target itself (a plain forward pass over the context, no
  cache, once per context) and places the target's greedy token at a chosen rank: rank 0
  everywhere gives full acceptance; ``greedy_rank`` returning None at draft position k gives
  a drafter that is right exactly up to position k; rank 1 puts it second, which only a tree
  can accept.
- :class:`RandomDrafter` proposes tokens drawn from a generator seeded by the context, so
  its proposals are deterministic and independent of call order.

Proposal probabilities follow a fixed profile (``top_prob`` first, the rest halving), so
tree scores, and hence which nodes get verified, are predictable.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipeline.drafters.protocol import CandidateTree

# greedy_rank(context, draft_position) -> rank of the target's greedy token, None: absent
RankFn = Callable[[Sequence[int], int], "int | None"]


def probability_profile(k: int, top_prob: float) -> torch.Tensor:
    """(k,) strictly decreasing probabilities: ``top_prob``, then halving shares of the rest."""
    if not 0.0 < top_prob <= 1.0:
        raise ValueError(f"top_prob must be in (0, 1], got {top_prob}")
    if k == 1:
        return torch.tensor([top_prob])
    rest = torch.tensor([0.5 ** r for r in range(k - 1)])
    return torch.cat([torch.tensor([top_prob]), (1.0 - top_prob) * rest / rest.sum()])


class _ContextDrafter:
    """Tracks the verified tokens; subclasses choose from (context, draft position)."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.context: list[int] = []

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.context = [int(prompt_ids[0])] if len(prompt_ids) else []

    def extend(self, next_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.context.extend(int(t) for t in next_tokens.tolist())

    def propose(self, tree: CandidateTree, frontier: Sequence[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        contexts = [self.context + tree.path_tokens(node) for node in frontier]
        positions = [tree.depth(node) for node in frontier]
        return self.choose(contexts, positions, k)

    def choose(self, contexts: list[list[int]], positions: list[int], k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


# The oracle's answers, by target, then (context, n): a pure function of the context, asked
# again and again (the context an accepted path leads to was a frontier node's in the cycle
# before, and the lossless tests decode the same prompts with many settings), each asking a
# plain forward pass of the target (~5 ms). Weakly keyed: they go with their target.
_TOP_TOKENS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[tuple[int, ...], int], list[int]]] \
    = weakref.WeakKeyDictionary()


class OracleDrafter(_ContextDrafter):
    """Proposes the target's own top tokens, its greedy token at rank ``greedy_rank``."""

    def __init__(self, target: nn.Module, *, top_prob: float = 0.9,
                 greedy_rank: RankFn | None = None):
        super().__init__()
        self.target = target
        self.top_prob = top_prob
        self.greedy_rank = greedy_rank or (lambda _context, _position: 0)

    def choose(self, contexts: list[list[int]], positions: list[int], k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for row, context, position in zip(self._top(contexts, k + 1), contexts, positions,
                                          strict=True):
            greedy, others = row[0], row[1:k + 1]
            rank = self.greedy_rank(context, position)
            if rank is None or rank >= k:
                rows.append(others[:k])
            else:
                rows.append(others[:rank] + [greedy] + others[rank:k - 1])
        probs = probability_profile(k, self.top_prob).expand(len(rows), k)
        return probs.clone(), torch.tensor(rows, dtype=torch.long)

    @torch.inference_mode()
    def _top(self, contexts: list[list[int]], n: int) -> list[list[int]]:
        """The target's ``n`` most likely next tokens after each context, best first (ties:
        the lower id); those not in :data:`_TOP_TOKENS` yet in one forward pass."""
        known = _TOP_TOKENS.setdefault(self.target, {})
        new = [c for c in dict.fromkeys((tuple(c), n) for c in contexts) if c not in known]
        if new:
            device = next(self.target.parameters()).device
            ids = torch.tensor([c for c, _ in new], device=device)  # (F, T): equal lengths
            logits = self.target(input_ids=ids, use_cache=False).logits[:, -1].float()
            ranked = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (F, V)
            known.update(zip(new, ranked[:, :n].tolist(), strict=True))
        return [known[tuple(c), n] for c in contexts]


class RandomDrafter(_ContextDrafter):
    """Uniformly random distinct tokens, seeded by ``seed`` and the context."""

    def __init__(self, vocab_size: int, *, seed: int = 0, top_prob: float = 0.5):
        super().__init__()
        self.vocab_size = vocab_size
        self.seed = seed
        self.top_prob = top_prob

    def choose(self, contexts: list[list[int]], positions: list[int], k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for context in contexts:
            g = torch.Generator().manual_seed(context_seed(self.seed, context))
            rows.append(torch.randperm(self.vocab_size, generator=g)[:k])
        probs = probability_profile(k, self.top_prob).expand(len(rows), k)
        return probs.clone(), torch.stack(rows)


def context_seed(seed: int, tokens: Sequence[int]) -> int:
    """A stable 32-bit seed from ``seed`` and a token sequence (no Python ``hash``)."""
    data = torch.tensor([seed, *tokens], dtype=torch.int64).numpy().tobytes()
    return zlib.crc32(data)
