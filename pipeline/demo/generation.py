"""Batched generation with a KV cache for the demo policy (sampling or greedy).

Responsible for turning prompt ids into response ids exactly as the policy emitted them,
with a finish reason. Prompts are left-padded into one batch; sampling draws from an
explicit ``torch.Generator`` so a run is reproducible for a fixed seed, thread count and
deterministic algorithms. A response includes the EOS token when one was emitted
(``finish_reason="stop"``); otherwise it holds ``max_new_tokens`` ids (``"length"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class Generation:
    """One generated response: the sampled ids and why generation stopped."""

    token_ids: list[int]
    finish_reason: str  # "stop" (EOS emitted, included in token_ids) or "length"


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ``sequences`` into ``(ids, attention_mask)``, both ``(B, T)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Generation]:
    """Generate one response per prompt; ``temperature <= 0`` means greedy.

    Sampling uses ``generator`` (required unless greedy), never the global RNG.
    """
    greedy = temperature <= 0
    if not greedy and generator is None:
        raise ValueError("sampling needs an explicit torch.Generator")
    was_training = model.training
    model.eval()
    ids, mask = left_pad(prompts, pad_id)  # (B, T)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = ids.shape[0]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    next_pos = positions[:, -1:] + 1  # (B, 1)
    done = torch.zeros(batch, dtype=torch.bool)
    steps: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()  # (B, V)
        if greedy:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        steps.append(token)
        done = done | (token == eos_id)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=-1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos,
                    past_key_values=out.past_key_values, use_cache=True)
        next_pos = next_pos + 1
    model.train(was_training)
    tokens = torch.stack(steps, dim=1).tolist()  # (B, steps)
    results = []
    for row in tokens:
        if eos_id in row:
            results.append(Generation(row[: row.index(eos_id) + 1], "stop"))
        else:
            results.append(Generation(row, "length"))
    return results
