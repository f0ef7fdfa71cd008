"""The DFlash drafter: Qwen3-style layers that fill a block of mask tokens in one pass.

Parameter names are the engines' (SGLang ``DFlashDraftModel``, vLLM ``qwen3_dflash``), so the
state dict is the checkpoint: ``fc``, ``hidden_norm``, ``layers.{i}.{input_layernorm,
post_attention_layernorm}``, ``layers.{i}.self_attn.{q,k,v,o}_proj`` and ``{q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``. The token embedding and the head are the
target's, held as buffers that are neither trained nor saved.

One block (shapes for B rows, C context positions, Q block positions, H hidden, K target
layers, nh/nkv heads of size d):

    c        (B, C, H)    hidden_norm(fc(target features (B, C, K·H)))   -- the context
    b        (B, Q, H)    embed(block tokens): the anchor, then mask tokens
    per layer:
      x      (B, Q, H)    input_layernorm(b)
      q      (B, nh, Q, d)     q_norm(q_proj(x)), RoPE at the block positions
      k, v   (B, nkv, C+Q, d)  [k_norm(k_proj(c)) ; k_norm(k_proj(x))], RoPE at each one's
                               position; v without norm or RoPE
      b      b + o_proj(attention(q, k, v, allowed))     -- allowed (B, Q, C+Q) by the caller
      b      b + mlp(post_attention_layernorm(b))
    logits   (B, Q, V)    norm(b) @ target lm_head.T

Block slot j (j >= 1) at position ``a + j`` predicts the token AT that position; slot 0 (the
anchor) is never read. Training (:mod:`pipeline.dflash.objective`) and drafting
(:mod:`pipeline.dflash.proposer`) share every weight-bearing op and differ only in the
``allowed`` mask and which context keys they hold.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.dflash.config import DFlashConfig
from pipeline.eagle3.model import (
    MLP,
    FrozenEmbedding,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    repeat_kv,
)

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v (B, nkv, C, d)


def exported_names(config: DFlashConfig) -> tuple[str, ...]:
    """The tensors of an exported DFlash drafter (the engines' names)."""
    per_layer = ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    layers = tuple(f"layers.{i}.{n}" for i in range(config.num_hidden_layers)
                   for n in per_layer)
    return ("fc.weight", "hidden_norm.weight", *layers, "norm.weight")


class Attention(nn.Module):
    """Qwen3 attention projections with per-head q/k norms."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, H) -> k (B, nkv, T, d) normed and rotated, v (B, nkv, T, d)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        return apply_rope(q.transpose(1, 2), cos, sin)  # (B, nh, T, d)


class Layer(nn.Module):
    """One DFlash layer: block queries over the context's and the block's keys."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, block: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor], allowed: torch.Tensor,
                scale: float) -> torch.Tensor:
        attn = self.self_attn
        x = self.input_layernorm(block)  # (B, Q, H)
        q = attn.queries(x, cos, sin)
        k, v = attn.keys(x, cos, sin)
        keys = torch.cat([context[0], k], dim=2)  # (B, nkv, C+Q, d)
        values = torch.cat([context[1], v], dim=2)
        rep = attn.num_heads // attn.num_kv_heads
        out = F.scaled_dot_product_attention(
            q, repeat_kv(keys, rep), repeat_kv(values, rep), attn_mask=allowed.unsqueeze(1),
            scale=scale)  # (B, nh, Q, d)
        b, nh, t, d = out.shape
        block = block + attn.o_proj(out.transpose(1, 2).reshape(b, t, nh * d))
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashDrafter(nn.Module):
    """DFlash draft model with the engines' parameter names (module docstring)."""

    def __init__(self, config: DFlashConfig, embed_weight: torch.Tensor,
                 head_weight: torch.Tensor):
        """``embed_weight`` and ``head_weight``: the target's (vocab_size, hidden_size)
        token embedding and ``lm_head`` (the same tensor for a tied target)."""
        super().__init__()
        want = (config.vocab_size, config.hidden_size)
        for name, w in (("embedding", embed_weight), ("lm_head", head_weight)):
            if tuple(w.shape) != want:
                raise ValueError(f"the target's {name} is {tuple(w.shape)}, the drafter needs "
                                 f"(vocab_size, hidden_size) = {want}")
        self.config = config
        self.embed_tokens = FrozenEmbedding(embed_weight)
        self.register_buffer("head", head_weight.detach(), persistent=False)
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.apply(_init_weights)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """(B, C, K·H) target layer outputs -> (B, C, H) the context the layers attend to."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's keys and values of ``context`` (B, C, H) at ``positions`` (B, C)."""
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        return [layer.self_attn.keys(context, cos, sin) for layer in self.layers]

    def blocks(self, tokens: torch.Tensor, positions: torch.Tensor, context: ContextKV,
               allowed: torch.Tensor) -> torch.Tensor:
        """Block tokens (B, Q) at ``positions`` (B, Q), each query seeing the keys
        ``allowed`` (B, Q, C+Q) marks -> the last layer's output (B, Q, H)."""
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        out = self.embed_tokens(tokens).to(self.dtype)
        for layer, kv in zip(self.layers, context, strict=True):
            out = layer(out, cos, sin, kv, allowed, self.scale)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(…, H) -> (…, V) logits over the target's whole vocab, by the target's head."""
        return self.norm(hidden) @ self.head.to(self.dtype).T

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the tensors the engines load (:func:`exported_names`), detached."""
        state, names = self.state_dict(), exported_names(self.config)
        if set(state) != set(names):
            raise RuntimeError(f"DFlash state dict drifted from the engines' names: "
                               f"{sorted(set(state) ^ set(names))}")
        return {name: state[name].detach() for name in names}


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
