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

from pipeline.attention_kernels import shape_stable


@torch.inference_mode()
def greedy_reference(model: nn.Module, prompt: Sequence[int], max_new_tokens: int,
                     eos: frozenset[int] = frozenset()) -> list[int]:
    """The target's greedy continuation of ``prompt``: up to and including the first token in
    ``eos``, at most ``max_new_tokens`` tokens."""
    device = next(model.parameters()).device
    ids, out = list(prompt), []
    with shape_stable():
        while len(out) < max_new_tokens:
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False,
                           logits_to_keep=1).logits  # (1, 1, V)
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in eos:
                break
    return out


# A divergence from the expected greedy tokens is a tie, not a bug, when the expected
# token's logit beat the emitted one by at most this share of the top logit's magnitude
# (at least 1) on the cache-free pass. fp32 is held exact. bf16 keeps 8 significant bits:
# a logit is rounded to within 2^-9 of itself and every layer's hidden state is rounded too,
# so two computation orders (a tree pass and a one-token pass) can reorder logits a few
# units of 2^-8 apart; 2^-5 leaves room for that and still refuses a real difference.
TIE_TOLERANCE = {"float32": 0.0, "bfloat16": 2.0 ** -5}


@torch.inference_mode()
def is_near_tie(model: nn.Module, prompt: Sequence[int], expected: Sequence[int],
                got: Sequence[int], tolerance: float) -> bool:
    """Whether ``got`` first leaves ``expected`` (both continuations of ``prompt``) at a
    token whose logit is within ``tolerance`` (see :data:`TIE_TOLERANCE`) of the expected
    one's on a cache-free pass. Sequences that differ only in length (one stopped
    earlier) are never ties."""
    if tolerance <= 0:
        return False
    at = next((t for t, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    if at is None:
        return False
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *expected[:at]]], device=device)
    with shape_stable():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    gap = abs(float(logits[expected[at]] - logits[got[at]]))  # either side may be wrong
    return gap <= tolerance * max(1.0, float(logits.abs().max()))
