"""The target model during speculative decoding: one sequence, a KV cache, aux features.

Wraps a transformers causal LM with ``model.model.layers``. Three operations:

- :meth:`TargetRunner.prefill` runs the prompt (positions ``0..P-1``) into a fresh cache and
  returns the next-token logits and the EAGLE-3 aux features of every prompt position;
- :meth:`TargetRunner.verify` runs a draft tree in ONE forward pass: node i at position
  ``L + depth_i`` (L = cached length), attending to the cache plus its own ancestors;
- :meth:`TargetRunner.keep` drops the KV entries of rejected tree nodes (an index select on
  the sequence axis), so the cache again holds exactly the verified sequence.

Attention windows. Every layer keeps its whole history in a plain (unbounded) cache, and
the runner writes every attention mask itself (4D, additive), one per mask kind the model
reads (:func:`attention_windows`): a sliding-window layer of window ``W`` lets a query at
position ``q`` see a key at position ``k`` only when ``q - k < W`` (transformers' rule),
in the prompt, against the cache, and between tree nodes alike. So the verified tokens equal
the target's own greedy decoding past the window too. Layer kinds other than full and
sliding attention (linear attention, chunked attention, recurrent state) are refused when
the runner is built: :class:`UnsupportedTarget` names the kind.

Length-dependent RoPE. ``longrope`` (Phi-3/3.5/4-mini) and ``dynamic`` NTK rotate every
position differently once the sequence passes ``original_max_position_embeddings``
(``longrope``) or ``max_position_embeddings`` (``dynamic``): transformers recomputes the
frequencies per forward pass from the longest position, so
keys cached below that length and a full recomputation disagree past it: no cached decoder,
this one or a serving engine's, reproduces the model there. :meth:`TargetRunner.check_length`
refuses such a sequence before it is decoded (:func:`exact_length_limit`).

Invariants:

- After ``prefill`` / ``keep``, the cache holds one entry per verified token before the root,
  in sequence order: cache index == position == ``length`` for the root.
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

FULL, SLIDING = "full_attention", "sliding_attention"
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")


class UnsupportedTarget(ValueError):
    """A target whose attention the evaluation engine cannot reproduce exactly."""


def attention_windows(config: Any) -> dict[str | None, int | None]:
    """The masks a target's decoder reads: ``{mask kind: window}`` (None = no window).

    Models with ``config.layer_types`` (Qwen2/3, Gemma-2/3, GPT-OSS, ...) take a dict of
    masks keyed by layer type; the others (Llama, Mistral, Phi-3, Qwen3-MoE, DeepSeek-V3)
    take one mask, windowed for every layer when ``config.sliding_window`` is set. Raises
    :class:`UnsupportedTarget` for any other layer type.
    """
    window = getattr(config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise UnsupportedTarget(f"sliding_window {window!r} of the target is not a positive "
                                "int")
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {None: window}
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedTarget(
            f"{type(config).__name__}: layer types {unknown} cannot be evaluated (the engine "
            f"runs {FULL!r} and {SLIDING!r} layers only)")
    if SLIDING in layer_types and window is None:
        raise UnsupportedTarget(f"{type(config).__name__}: sliding_attention layers but no "
                                "sliding_window")
    return {kind: (window if kind == SLIDING else None) for kind in sorted(set(layer_types))}


def exact_length_limit(config: Any) -> int | None:
    """The longest sequence decoded exactly with a KV cache (module docstring), or None.

    As transformers switches: ``longrope`` past ``original_max_position_embeddings``,
    ``dynamic`` past ``max_position_embeddings``."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)]
    limits = []
    for p in nested or [params]:
        if p.get("rope_type") == "longrope":
            limits.append(int(p.get("original_max_position_embeddings")
                              or getattr(config, "original_max_position_embeddings", None)
                              or config.max_position_embeddings))
        elif p.get("rope_type") == "dynamic":
            limits.append(int(config.max_position_embeddings))
    return min(limits, default=None)


class TargetRunner:
    """One sequence's target state (see the module docstring)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int] = ()):
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise TypeError(f"{type(model).__name__}: expected a causal LM with "
                            "`.model.layers`")
        if aux_layer_ids:  # hooks below record Aerie's convention: the output of layer l
            aux_layer_ids = check_aux_layer_ids(aux_layer_ids, len(base.layers))
        self.model = model
        self.layers = base.layers
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.windows = attention_windows(model.config)
        self.length_limit = exact_length_limit(model.config)
        self.hidden_size = int(model.config.hidden_size)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        """Cached positions (= position of the next token fed)."""
        return self.cache.get_seq_length()

    def check_length(self, length: int) -> None:
        """Refuse a sequence of ``length`` tokens the target's RoPE makes inexact."""
        if self.length_limit is not None and length > self.length_limit:
            raise UnsupportedTarget(
                f"a {length}-token sequence passes the target's original_max_position_embeddings "
                f"({self.length_limit}), where its length-dependent RoPE "
                f"({'/'.join(LENGTH_DEPENDENT_ROPE)}) changes every position's rotation: no "
                "cached decoder reproduces it there; shorten the prompts or max_new_tokens")

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``prompt`` (P,) -> (next-token logits (V,), aux (P, A) or None). Resets the
        cache."""
        self.cache = DynamicCache()
        ids = prompt.to(self.device).view(1, -1)  # (1, P)
        p = ids.shape[1]
        positions = torch.arange(p, device=self.device)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        with self._capture(p) as aux:
            out = self.model(input_ids=ids, attention_mask=self._masks(positions, positions,
                                                                       causal),
                             position_ids=positions.view(1, p), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], aux

    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tree nodes ``tokens`` (N,), ``depths`` (N,), ``ancestors`` (N, N) bool ->
        (the target's next-token logits at every node (N, V), aux (N, A) or None).

        Appends the N nodes' KV entries; call :meth:`keep` afterwards.
        """
        n, past = tokens.shape[0], self.length
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.device)  # (N, L+N)
        allowed[:, past:] = ancestors.to(self.device)
        positions = past + depths.to(self.device)  # (N,)
        keys = torch.cat([torch.arange(past, device=self.device), positions])  # (L+N,)
        with self._capture(n) as aux:
            out = self.model(input_ids=tokens.to(self.device).view(1, n),
                             attention_mask=self._masks(positions, keys, allowed),
                             position_ids=positions.view(1, n), past_key_values=self.cache,
                             use_cache=True)
        return out.logits[0], aux  # (N, V)

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

    def _masks(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor
               ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive (1, 1, T, S) masks: ``allowed`` (T, S), cut to each kind's window by
        the positions of queries (T,) and keys (S,). A dict when the model reads one mask
        per layer type."""
        masks = {}
        for kind, window in self.windows.items():
            ok = allowed
            if window is not None:
                ok = allowed & (queries[:, None] - keys[None, :] < window)
            mask = torch.zeros(ok.shape, dtype=self.dtype, device=self.device)
            masks[kind] = mask.masked_fill_(~ok, torch.finfo(self.dtype).min)[None, None]
        return masks[None] if None in masks else masks

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
