"""The target model during speculative decoding: one sequence, a KV cache, aux features.

Wraps a transformers Llama-style causal LM (``model.model.layers``). Three operations:

- :meth:`TargetRunner.prefill` runs the prompt (positions ``0..P-1``) into a fresh cache and
  returns the greedy next token and the EAGLE-3 aux features of every prompt position;
- :meth:`TargetRunner.verify` runs a draft tree in ONE forward pass: node i at position
  ``L + depth_i`` (L = cached length), attending to the whole cache plus its own ancestors
  (a 4D additive mask; HF passes a 4D mask through untouched);
- :meth:`TargetRunner.keep` drops the KV entries of rejected tree nodes (an index select on
  the sequence axis), so the cache again holds exactly the verified sequence.

Invariants:

- After ``prefill`` / ``keep``, the cache holds one entry per verified token before the root,
  in sequence order: ``length`` == the root's position. No extra forward pass ever fixes it.
- Aux layer id ``l`` is the OUTPUT of decoder layer ``l`` (a forward hook, as in capture:
  ``pipeline.capture.hf``), concatenated in the given order: the drafter sees the same
  features at inference as in training, including for ``l = N - 1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.eagle3.aux_layers import check_aux_layer_ids


class TargetRunner:
    """One sequence's target state (see the module docstring)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int] = ()):
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise TypeError(f"{type(model).__name__}: expected a causal LM with "
                            "`.model.layers` (Llama-style)")
        if aux_layer_ids:  # hooks below record Aerie's convention: the output of layer l
            aux_layer_ids = check_aux_layer_ids(aux_layer_ids, len(base.layers))
        self.model = model
        self.layers = base.layers
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.hidden_size = int(model.config.hidden_size)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        """Cached positions (= position of the next token fed)."""
        return self.cache.get_seq_length()

    def prefill(self, prompt: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """``prompt`` (P,) -> (greedy next token, aux (P, A) or None). Resets the cache."""
        self.cache = DynamicCache(config=self.model.config)
        ids = prompt.to(self.device).view(1, -1)  # (1, P)
        with self._capture(ids.shape[1]) as aux:
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1)
        return int(out.logits[0, -1].argmax()), aux

    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tree nodes ``tokens`` (N,), ``depths`` (N,), ``ancestors`` (N, N) bool ->
        (the target's argmax at every node (N,), aux (N, A) or None).

        Appends the N nodes' KV entries; call :meth:`keep` afterwards.
        """
        n, past = tokens.shape[0], self.length
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.device)  # (N, L+N)
        allowed[:, past:] = ancestors.to(self.device)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        positions = (past + depths).to(self.device).view(1, n)  # (1, N)
        with self._capture(n) as aux:
            out = self.model(input_ids=tokens.to(self.device).view(1, n),
                             attention_mask=mask.view(1, 1, n, past + n),
                             position_ids=positions, past_key_values=self.cache,
                             use_cache=True)
        return out.logits[0].argmax(-1).cpu(), aux  # (N,)

    def keep(self, prefix: int, tree_nodes: Sequence[int]) -> None:
        """Keep cache entries ``0..prefix-1`` and the tree nodes ``tree_nodes`` (in order),
        where tree node i sits at cache index ``prefix + i``."""
        index = torch.cat([torch.arange(prefix),
                           prefix + torch.as_tensor(list(tree_nodes), dtype=torch.long)])
        index = index.to(self.device)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(f"cannot prune a {type(layer).__name__} cache layer")
            layer.keys = layer.keys.index_select(-2, index)  # (1, nkv, S, d)
            layer.values = layer.values.index_select(-2, index)

    @contextlib.contextmanager
    def _capture(self, t: int) -> Iterator[torch.Tensor | None]:
        """Copy each aux layer's output (1, t, H) into its slot of one (t, A) buffer."""
        if not self.aux_layer_ids:
            yield None
            return
        h = self.hidden_size
        aux = torch.empty(t, h * len(self.aux_layer_ids), dtype=self.dtype,
                          device=self.device)  # (t, 3H)
        handles = []
        for slot, layer_id in enumerate(self.aux_layer_ids):
            def hook(_m: nn.Module, _a: Any, output: Any, slot: int = slot) -> None:
                hidden = output[0] if isinstance(output, tuple) else output  # (1, t, H)
                aux[:, slot * h:(slot + 1) * h].copy_(hidden[0])
            handles.append(self.layers[layer_id].register_forward_hook(hook))
        try:
            yield aux
        finally:
            for handle in handles:
                handle.remove()
