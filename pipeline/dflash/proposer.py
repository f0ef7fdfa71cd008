"""A :class:`~pipeline.dflash.model.DFlashDrafter` run as the engines run it: one pass per cycle.

State for one sequence: every layer's context keys and values of the verified positions
(the engines project each verified token's target features once, into the draft KV cache)
and the next root. A cycle's first ``propose`` (frontier ``[ROOT]``) runs the block: the root
at position C (C verified positions with features) and ``block_size - 1`` mask tokens after
it, all seeing every context key and each other. Depth j's choices are then the top-k of
slot j, whichever node asks: the block is drafted as a chain (the engines verify DFlash
drafts as a chain; a tree would repeat the same choices under every sibling).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.dflash.model import ContextKV, DFlashDrafter
from pipeline.drafters.protocol import ROOT, CandidateTree


class DFlashProposer:
    """The engine's :class:`~pipeline.drafters.protocol.Drafter` for a DFlash model."""

    def __init__(self, model: DFlashDrafter):
        self.model = model
        self.device = model.fc.weight.device
        self.reset(())

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.model.config.target_layer_ids)

    @property
    def committed(self) -> int:
        return int(self._context[0][0].shape[2]) if self._context else 0

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self._context: ContextKV = []
        self._root: int | None = None
        self._block: torch.Tensor | None = None  # (B-1, V) probabilities of slots 1..B-1

    def extend(self, next_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Add the features ``aux`` (n, K·H) of the next n verified positions; the last next
        token is the next cycle's root."""
        if aux is None:
            raise ValueError("a DFlash drafter needs the target's layer features")
        n, c = int(next_tokens.shape[0]), self.committed
        positions = torch.arange(c, c + n, device=self.device).view(1, n)
        new = self.model.context_kv(self.model.context(aux.to(self.device).unsqueeze(0)),
                                    positions)
        self._context = new if not self._context else [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
            for (k, v), (nk, nv) in zip(self._context, new, strict=True)]
        self._root = int(next_tokens[-1])

    def propose(self, tree: CandidateTree, frontier: Sequence[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._root is None:
            raise RuntimeError("propose() before any extend()")
        if list(frontier) == [ROOT]:
            self._block = self._draft_block()
            depth = 0
        else:
            depths = {tree.depth(n) for n in frontier}
            if len(depths) != 1 or len(frontier) != 1:
                raise ValueError("a DFlash drafter drafts a chain: one node per depth "
                                 f"(got {len(frontier)} at depths {sorted(depths)})")
            depth = depths.pop()
        assert self._block is not None
        if depth >= self._block.shape[0]:
            raise ValueError(f"a block of {self.model.config.block_size} drafts "
                             f"{self._block.shape[0]} tokens; depth {depth + 1} asked")
        probs = self._block[depth].view(1, -1)
        top_p, top_i = torch.topk(probs, k, dim=-1)
        return top_p.cpu(), top_i.cpu()

    def _draft_block(self) -> torch.Tensor:
        cfg, c = self.model.config, self.committed
        size = cfg.block_size
        tokens = torch.full((1, size), cfg.mask_token_id, dtype=torch.long, device=self.device)
        tokens[0, 0] = self._root
        positions = torch.arange(c, c + size, device=self.device).view(1, size)
        allowed = torch.ones(1, size, c + size, dtype=torch.bool, device=self.device)
        hidden = self.model.blocks(tokens, positions, self._context or self._empty(), allowed)
        return torch.softmax(self.model.compute_logits(hidden[0, 1:]).float(), dim=-1)

    def _empty(self) -> ContextKV:
        cfg = self.model.config
        shape = (1, cfg.num_key_value_heads, 0, cfg.head_dim)
        empty = torch.empty(shape, dtype=self.model.dtype, device=self.device)
        return [(empty, empty)] * cfg.num_hidden_layers
