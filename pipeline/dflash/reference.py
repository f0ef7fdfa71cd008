"""DFlash's block, written out from the equations one position at a time (plain RoPE).

An independent reading of a :class:`~pipeline.dflash.model.DFlashDrafter`'s weights: no
``scaled_dot_product_attention``, no masks, no shared forward code; every block query attends
to every context position it is given and to the whole block. Training
(:func:`pipeline.dflash.objective.block_loss`) and drafting
(:class:`pipeline.dflash.proposer.DFlashProposer`) are tested against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.dflash.model import DFlashDrafter


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x (heads, d) rotated to ``position`` (the halves layout)."""
    d = x.shape[-1]
    freq = position / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    cos, sin = freq.cos().to(x.dtype), freq.sin().to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def block_logits(model: DFlashDrafter, features: torch.Tensor, tokens: list[int],
                 start: int) -> torch.Tensor:
    """Logits (len(tokens) - 1, V) of slots 1.. of the block ``tokens`` (anchor first) at
    positions ``start``.., over the context ``features`` (C, K·H) at positions 0..C-1."""
    cfg, eps = model.config, model.config.rms_norm_eps
    if cfg.rope_type != "default":
        raise ValueError("the reference rotates with plain RoPE only")
    state = {k: v.double() for k, v in model.state_dict().items()}
    head = model.head.double()
    embed = model.embed_tokens.weight.double()
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    context = _rms(features.double() @ state["fc.weight"].T, state["hidden_norm.weight"], eps)
    block = torch.stack([embed[t] for t in tokens])  # (Q, H)
    c = context.shape[0]
    for i in range(cfg.num_hidden_layers):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in state.items()
             if k.startswith(f"layers.{i}.")}
        x = _rms(block, w["input_layernorm.weight"], eps)
        sources = [(context[p], p) for p in range(c)] + \
                  [(x[j], start + j) for j in range(len(tokens))]
        keys, values = [], []
        for row, position in sources:
            k = _rms((w["self_attn.k_proj.weight"] @ row).view(nkv, d),
                     w["self_attn.k_norm.weight"], eps)
            keys.append(_rotate(k, position, cfg.rope_theta))
            values.append((w["self_attn.v_proj.weight"] @ row).view(nkv, d))
        outs = []
        for j in range(len(tokens)):
            q = _rms((w["self_attn.q_proj.weight"] @ x[j]).view(nh, d),
                     w["self_attn.q_norm.weight"], eps)
            q = _rotate(q, start + j, cfg.rope_theta)
            heads = []
            for h in range(nh):
                g = h // (nh // nkv)
                scores = torch.stack([q[h] @ k[g] for k in keys]) / math.sqrt(d)
                p = torch.softmax(scores, dim=0)
                heads.append(sum(pi * v[g] for pi, v in zip(p, values, strict=True)))
            outs.append(w["self_attn.o_proj.weight"] @ torch.cat(heads))
        block = block + torch.stack(outs)
        y = _rms(block, w["post_attention_layernorm.weight"], eps)
        block = block + (F.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)
                         ) @ w["mlp.down_proj.weight"].T
    return (_rms(block, state["norm.weight"], eps) @ head.T)[1:]
