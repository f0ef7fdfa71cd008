"""The independent reference for the lossless check: the target's plain greedy loop.

One full forward pass over the whole sequence per generated token, no KV cache, no masks
of ours: transformers builds its own (causal, sliding-window) masks. It shares nothing with
the engine's cache, pruning or tree masks, so a bug there cannot hide by agreeing with
itself (:mod:`pipeline.evaluation.engine` compares against its own no-drafter decoding too).
Quadratic in the length: the stage runs it on a sample of the prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.inference_mode()
def greedy_reference(model: nn.Module, prompt: Sequence[int], max_new_tokens: int,
                     eos: frozenset[int] = frozenset()) -> list[int]:
    """The target's greedy continuation of ``prompt``: up to and including the first token in
    ``eos``, at most ``max_new_tokens`` tokens."""
    device = next(model.parameters()).device
    ids, out = list(prompt), []
    while len(out) < max_new_tokens:
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False,
                       logits_to_keep=1).logits  # (1, 1, V)
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


def reference_sample(lengths: Sequence[int], k: int) -> list[int]:
    """Indices of the ``k`` longest prompts (ties: the earlier), in prompt order: the ones
    that reach furthest past a sliding window and exercise the cache the most."""
    ranked = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(ranked[:k])
