"""The drafter protocol: what the engine needs from anything that proposes draft tokens.

The engine drives a drafter through one sequence at a time:

1. ``reset(prompt_ids)`` when a prompt starts;
2. ``extend(next_tokens, aux)`` after the prefill and after every cycle, with the newly
   verified positions s: the target's aux features at s (``aux`` row i, or None when
   ``aux_layer_ids`` is empty) paired with the token that followed s (``next_tokens[i]`` =
   x_{s+1}). After it the drafter has seen the verified sequence x_0..x_L, where x_L (the
   last next token) is the ROOT of the next cycle;
3. ``propose(tree, frontier, k)`` during drafting: the top-k next-token choices after each
   frontier node (``ROOT`` or a node of ``tree``; see :mod:`pipeline.evaluation.tree`), as
   ``(probs (F, k) fp32, target token ids (F, k))``, best first, ids distinct per row. A
   cycle's first call is ``frontier == [ROOT]``; later calls expand nodes of that cycle's tree.

Nothing a drafter does changes what is emitted (verification is lossless: token for token
when greedy, in distribution when sampled); it only changes how many tokens each cycle
emits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from pipeline.eagle3.model import Eagle3Drafter
from pipeline.evaluation.tree import CandidateTree


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


def as_drafter(obj: Eagle3Drafter | Drafter) -> Drafter:
    """An :class:`Eagle3Drafter` wrapped for the engine, or a :class:`Drafter` as is."""
    if isinstance(obj, Eagle3Drafter):
        from pipeline.evaluation.eagle import Eagle3Proposer

        return Eagle3Proposer(obj)
    if isinstance(obj, Drafter):
        return obj
    raise TypeError(f"{type(obj).__name__} is neither an Eagle3Drafter nor a Drafter")
