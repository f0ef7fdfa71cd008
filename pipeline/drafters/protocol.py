"""The drafter protocol: what the engine needs from anything that proposes draft tokens.

The engine drives a drafter through one sequence at a time:

1. ``reset(prompt_ids)`` when a prompt starts;
2. ``extend(next_tokens, aux)`` after the prefill and after every cycle, with the newly
   verified positions s: the target's aux features at s (``aux`` row i, or None when
   ``aux_layer_ids`` is empty) paired with the token that followed s (``next_tokens[i]`` =
   x_{s+1}). After it the drafter has seen the verified sequence x_0..x_L, where x_L (the
   last next token) is the ROOT of the next cycle;
3. ``propose(tree, frontier, k)`` during drafting: the top-k next-token choices after each
   frontier node (``ROOT`` or a node of ``tree``, a :class:`CandidateTree`), as
   ``(probs (F, k) fp32, target token ids (F, k))``, best first, ids distinct per row. A
   cycle's first call is ``frontier == [ROOT]``; later calls expand nodes of that cycle's tree.

Nothing a drafter does changes what is emitted (verification is lossless: token for token
when greedy, in distribution when sampled); it only changes how many tokens each cycle
emits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

ROOT = -1  # the parent id of depth-1 candidates: the last verified token


@dataclass
class CandidateTree:
    """Every draft candidate of one cycle: token, parent (ROOT or an earlier node), depth."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for children of the root
    scores: list[torch.Tensor] = field(default_factory=list)  # per step, fp32 (n_step,)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens: Sequence[int], parents: Sequence[int], depth: int,
            scores: torch.Tensor) -> list[int]:
        """Append one step's candidates; returns their node ids."""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        self.parents.extend(int(p) for p in parents)
        self.depths.extend([depth] * len(tokens))
        self.scores.append(scores.float().reshape(-1))
        return list(range(start, len(self.tokens)))

    def depth(self, node: int) -> int:
        return 0 if node == ROOT else self.depths[node]

    def path(self, node: int) -> list[int]:
        """Node ids from depth 1 down to ``node`` (empty for the ROOT)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[n] for n in self.path(node)]


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for one sequence at a time (module docstring)."""

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs ``extend`` needs; empty: no features needed."""
        ...

    def reset(self, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, next_tokens: torch.Tensor, aux: torch.Tensor | None) -> None: ...

    def propose(self, tree: CandidateTree, frontier: Sequence[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

