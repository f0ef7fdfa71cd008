"""An :class:`~pipeline.eagle3.model.Eagle3Drafter` run as SGLang runs it during decoding.

State for one sequence:

- the *committed* KV cache, one entry per verified position s = (fc(aux_s), x_{s+1}) at RoPE
  position s, filled by draft extend (after the prefill: the whole prompt; after each cycle:
  the root and the accepted nodes, i.e. SGLang's draft extend after decode);
- ``last_hidden`` (H,): the un-normed output of the newest committed entry, whose logits
  give the depth-1 choices (SGLang captures them in the extend pass);
- per cycle, the *tree* KV entries and hidden outputs of the frontier nodes decoded so far.

A frontier node at depth j (j >= 1) is decoded with its own token, its parent's output as
hidden input (``last_hidden`` for depth 1; normed first for EAGLE 3.1's ``norm_output``,
:meth:`~pipeline.eagle3.model.Eagle3Drafter.feedback`) and RoPE position ``C - 1 + j`` (C committed
entries): exactly :func:`pipeline.eagle3.drafting.decode` on a cache holding the committed
entries plus the node's ancestors. Its attention sees all committed entries, its ancestors'
tree entries and itself (tree attention); siblings and cousins stay invisible. Tree entries
never enter the committed cache; draft extend writes the verified ones from real features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipeline.drafters.protocol import ROOT, CandidateTree
from pipeline.eagle3.model import Eagle3Drafter, repeat_kv


class Eagle3Proposer:
    """The engine's :class:`~pipeline.drafters.protocol.Drafter` for an EAGLE-3 model."""

    def __init__(self, model: Eagle3Drafter):
        self.model = model
        cfg = model.config
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        self.device = model.fc.weight.device
        self._kv_shape = (1, cfg.num_key_value_heads, 0, cfg.head_dim)
        self.reset(())

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.model.config.aux_layer_ids)

    @property
    def committed(self) -> int:
        return int(self._keys.shape[2])

    def reset(self, prompt_ids: Sequence[int]) -> None:
        dtype = self.model.dtype
        self._keys = torch.empty(self._kv_shape, dtype=dtype, device=self.device)  # (1,nkv,C,d)
        self._values = torch.empty(self._kv_shape, dtype=dtype, device=self.device)
        self._last_hidden: torch.Tensor | None = None  # (H,)
        self._reset_tree()

    def _reset_tree(self) -> None:
        self._tree_keys = torch.empty(self._kv_shape, dtype=self.model.dtype,
                                      device=self.device)  # (1, nkv, M, d)
        self._tree_values = torch.empty_like(self._tree_keys)
        self._slot: dict[int, int] = {}  # candidate node -> index into the tree KV
        self._hidden: dict[int, torch.Tensor] = {}  # candidate node -> output (H,)

    # -- draft extend ------------------------------------------------------------------
    def extend(self, next_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Commit positions C..C+n-1: aux (n, 3Ht) with next tokens (n,), causal attention."""
        if aux is None:
            raise ValueError("an EAGLE-3 drafter needs the target's aux features")
        n, c = next_tokens.shape[0], self.committed
        allowed = torch.ones(n, c + n, dtype=torch.bool, device=self.device)
        allowed[:, c:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(c, c + n, device=self.device).view(1, n)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._keys = torch.cat([self._keys, k], dim=2)  # (1, nkv, C+n, d)
            self._values = torch.cat([self._values, v], dim=2)
            return self._attend(q, self._keys, self._values, allowed)

        hidden = self.model.project(aux.to(self.device).unsqueeze(0))  # (1, n, H)
        out = self.model.step(next_tokens.to(self.device).view(1, n), hidden, positions,
                              attend)  # (1, n, H)
        self._last_hidden = out[0, -1]

    # -- drafting ----------------------------------------------------------------------
    def propose(self, tree: CandidateTree, frontier: Sequence[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last_hidden is None:
            raise RuntimeError("propose() before any extend()")
        if list(frontier) == [ROOT]:  # a new cycle
            self._reset_tree()
            hidden = self._last_hidden.view(1, -1)  # (1, H)
        else:
            hidden = self._decode(tree, list(frontier))  # (F, H)
        probs = torch.softmax(self.model.compute_logits(hidden).float(), dim=-1)  # (F, Vd)
        top_p, top_i = torch.topk(probs, k, dim=-1)  # (F, k)
        return top_p.cpu(), self.model.to_target_ids(top_i).cpu()

    def _decode(self, tree: CandidateTree, nodes: list[int]) -> torch.Tensor:
        """One draft step for frontier ``nodes`` (all of one depth) -> outputs (F, H)."""
        depths = {tree.depth(n) for n in nodes}
        if len(depths) != 1:
            raise ValueError(f"frontier mixes depths {sorted(depths)}")
        depth, f, c = depths.pop(), len(nodes), self.committed
        m = int(self._tree_keys.shape[2])
        allowed = torch.zeros(f, c + m + f, dtype=torch.bool)  # (F, C+M+F)
        allowed[:, :c] = True
        for i, node in enumerate(nodes):
            for ancestor in tree.path(node)[:-1]:
                allowed[i, c + self._slot[ancestor]] = True
            allowed[i, c + m + i] = True
        tokens = torch.tensor([tree.tokens[n] for n in nodes], device=self.device).view(1, f)
        hidden = torch.stack([self._parent_hidden(tree.parents[n]) for n in nodes])[None]
        positions = torch.full((1, f), self._node_position(c, depth), device=self.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._tree_keys = torch.cat([self._tree_keys, k], dim=2)  # (1, nkv, M+F, d)
            self._tree_values = torch.cat([self._tree_values, v], dim=2)
            keys = torch.cat([self._keys, self._tree_keys], dim=2)  # (1, nkv, C+M+F, d)
            values = torch.cat([self._values, self._tree_values], dim=2)
            return self._attend(q, keys, values, allowed.to(self.device))

        out = self.model.step(tokens, hidden, positions, attend)[0]  # (F, H)
        for i, node in enumerate(nodes):
            self._slot[node] = m + i
            self._hidden[node] = out[i]
        return out

    @staticmethod
    def _node_position(committed: int, depth: int) -> int:
        """RoPE position of a depth-``depth`` node; the root is entry ``committed - 1``."""
        return committed - 1 + depth

    def _parent_hidden(self, parent: int) -> torch.Tensor:
        assert self._last_hidden is not None
        return self.model.feedback(self._last_hidden if parent == ROOT else self._hidden[parent])

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """q (1, nh, T, d) over keys/values (1, nkv, S, d) where ``allowed`` (T, S)."""
        return F.scaled_dot_product_attention(
            q, repeat_kv(keys, self.n_rep), repeat_kv(values, self.n_rep),
            attn_mask=allowed.view(1, 1, *allowed.shape), scale=self.model.scale)
