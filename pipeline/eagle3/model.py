"""The EAGLE-3 drafter: one Llama decoder layer over [token embedding ; hidden state].

Parameter names are SGLang's (``LlamaForCausalLMEagle3``), so the state dict is the
checkpoint: ``fc``, ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}``,
``midlayer.self_attn.{q,k,v,o}_proj``, ``midlayer.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head``, buffers ``d2t`` (int64) and ``t2d`` (bool).

One draft step (shapes for B sequences of T positions, H hidden, nh/nkv heads of size d):

    h        (B, T, H)   fc(aux features) at step 0, else the previous step's output
    e        (B, T, H)   embed(token), the target's frozen embedding
    x        (B, T, 2H)  cat([input_layernorm(e), hidden_norm(h)])   -- embedding FIRST
    q        (B, nh, T, d), k/v (B, nkv, T, d)   from x, RoPE on q and k
    a        (B, T, H)   o_proj(attention(q, k, v))
    h1       (B, T, H)   h + a                  -- the residual is h (SGLang: residual = h)
    h_out    (B, T, H)   h1 + mlp(post_attention_layernorm(h1))
    logits   (B, T, Vd)  lm_head(norm(h_out))
    ``h_out`` (un-normed) is the hidden input of the next draft step.

Invariants:

- The attention itself is not part of the layer: :meth:`DecoderLayer.qkv` and
  :meth:`DecoderLayer.finish` wrap it, so training (``ttt.py``, a parallel chain) and
  reference drafting (``drafting.py``, a KV cache) share every weight-bearing op and differ
  only in which keys a query sees.
- ``embed_tokens`` holds the target's embedding as a non-persistent buffer: it never gets a
  gradient, is not in ``parameters()`` (so optimisers and ZeRO ignore it) and not in
  ``state_dict()`` (so neither checkpoints nor exports carry it). A drafter of another width
  than its target (``config.owns_embedding``) holds instead a fixed projection of the
  target's embedding (:func:`project_embedding`), still frozen but persistent: exported as
  ``embed_tokens.weight``, which SGLang and vLLM load as the draft's own embedding.
- RoPE frequencies are computed in fp32 from the config and never cast with the model, so
  ``model.to(torch.bfloat16)`` keeps exact positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.eagle3.config import DrafterConfig

# attend(q (B, nh, T, d), k (B, nkv, T, d), v (B, nkv, T, d)) -> (B, nh, T, d)
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EXPORTED_NAMES = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
OWN_EMBEDDING = "embed_tokens.weight"


def exported_names(config: DrafterConfig) -> tuple[str, ...]:
    """The tensors of an exported drafter: :data:`EXPORTED_NAMES`, EAGLE 3.1's norm of each
    aux state (``fc_norm.{i}.weight``) when it has them, and its own embedding when it is
    narrower or wider than the target."""
    fc_norms = tuple(f"fc_norm.{i}.weight" for i in range(len(config.aux_layer_ids))) \
        if config.fc_norm else ()
    return EXPORTED_NAMES + fc_norms + ((OWN_EMBEDDING,) if config.owns_embedding else ())


@torch.no_grad()
def project_embedding(weight: torch.Tensor, width: int) -> torch.Tensor:
    """The target's (V, Ht) embedding mapped to (V, ``width``) by a fixed orthonormal
    projection (seeded, so every run derives the same table from the same target): token
    geometry is kept as well as ``width`` allows, and the drafter's input norm rescales."""
    rows, cols = weight.shape[1], width
    basis = torch.randn(max(rows, cols), min(rows, cols),
                        generator=torch.Generator().manual_seed(0))
    q = torch.linalg.qr(basis).Q  # orthonormal columns
    projection = q if rows >= cols else q.T  # (Ht, width)
    return (weight.float() @ projection.to(weight.device)).to(weight.dtype)


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (HF's order of operations)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding:
    """Llama RoPE: plain, a static scaling (linear, llama3, yarn) or ``longrope``, whose
    long factors apply to a whole forward pass once its furthest position reaches
    ``original_max_position_embeddings`` (transformers' rule); no parameters."""

    def __init__(self, config: DrafterConfig):
        self.inv_freq, self.attention_scaling = rope_frequencies(config)  # (d/2,) fp32
        self.long_from: int | None = None  # positions >= this switch to long_inv_freq
        if config.rope_type == "longrope":
            self.long_from = int(config.rope_parameters["original_max_position_embeddings"])
            self.long_inv_freq, _ = rope_frequencies(config, seq_len=self.long_from + 1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``positions.shape + (d,)`` for integer ``positions``."""
        inv_freq = self.inv_freq
        if (self.long_from is not None and positions.numel()
                and int(positions.max()) >= self.long_from):
            inv_freq = self.long_inv_freq
        freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (..., d/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., d)
        return ((emb.cos() * self.attention_scaling).to(dtype),
                (emb.sin() * self.attention_scaling).to(dtype))


def rope_frequencies(config: DrafterConfig, seq_len: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """``(inv_freq (d/2,) fp32, attention_scaling)``; scaled types via transformers' table
    (``seq_len`` picks longrope's long factors when it passes the original length)."""
    if config.rope_type == "default":
        d = config.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        return 1.0 / (config.rope_theta ** exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=config.hidden_size,
                     num_attention_heads=config.num_attention_heads,
                     head_dim=config.head_dim,
                     max_position_embeddings=config.max_position_embeddings,
                     rope_parameters=config.rope_parameters)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf, None, seq_len)
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (B, heads, T, d) rotated by ``cos``/``sin`` (B, T, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, d)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, nkv, T, d) -> (B, nkv * n_rep, T, d); query head j uses kv head j // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class Attention(nn.Module):
    """Projections of the drafter's attention; q/k/v read the 2H-wide concatenated input."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """SGLang's EAGLE-3 ``midlayer``; the attention pattern is supplied by the caller."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, d), k and v (B, nkv, T, d), RoPE applied to q and k."""
        attn = self.self_attn
        b, t, _ = hidden.shape
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``residual`` (B, T, H) = the step's hidden input; ``attn_out`` (B, nh, T, d)."""
        b, nh, t, d = attn_out.shape  # explicit width: T may be 0 (a step with no rows)
        h = residual + self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, nh * d))
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H), un-normed


class FrozenEmbedding(nn.Module):
    """A token embedding as a buffer: no grad; saved only when ``persistent``.

    Shares memory with the tensor it is given (a 128k × 4096 table is worth not copying);
    nothing here writes to it.
    """

    def __init__(self, weight: torch.Tensor, persistent: bool = False):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=persistent)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft model with SGLang's parameter names (see the module docstring)."""

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor, *,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        """``embed_weight``: the target's ``(vocab_size, target_hidden_size)`` token
        embedding; for a drafter that owns its embedding, also its own ``(vocab_size,
        hidden_size)`` table (as exported).

        ``d2t``/``t2d`` default to the identity mapping onto the first ``draft_vocab_size``
        target ids; set the real ones with :meth:`set_vocab`.
        """
        super().__init__()
        shape = tuple(embed_weight.shape)
        own = (config.vocab_size, config.hidden_size)
        if shape != own and shape != (config.vocab_size, config.target_hidden_size):
            raise ValueError(f"embedding {shape} must be (vocab_size, hidden_size) = {own}"
                             + (f" or the target's ({config.vocab_size}, "
                                f"{config.target_hidden_size})" if config.owns_embedding
                                else ""))
        if shape != own:
            embed_weight = project_embedding(embed_weight, config.hidden_size)
        self.config = config
        self.embed_tokens = FrozenEmbedding(embed_weight, persistent=config.owns_embedding)
        self.fc_norm = nn.ModuleList(
            RMSNorm(config.target_hidden_size, config.rms_norm_eps)
            for _ in config.aux_layer_ids) if config.fc_norm else None
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d_default = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d_default[:config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d_default)
        self.rope = RotaryEmbedding(config)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.apply(_init_weights)
        if d2t is not None or t2d is not None:
            if d2t is None or t2d is None:
                raise ValueError("pass both d2t and t2d, or neither")
            self.set_vocab(d2t, t2d)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (see :mod:`pipeline.vocab.mapping`)."""
        check_vocab_mapping(d2t.cpu(), t2d.cpu())
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping shapes {tuple(d2t.shape)}, {tuple(t2d.shape)} do "
                             f"not match the drafter's {tuple(self.d2t.shape)}, "
                             f"{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # -- pieces of one draft step ------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, 3·Ht) target aux states -> (B, T, H): the step-0 hidden input (EAGLE 3.1:
        each aux state normed by its own ``fc_norm`` first)."""
        aux = aux_hidden.to(self.dtype)
        if self.fc_norm is not None:
            chunks = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)],
                            dim=-1)
        return self.fc(aux)

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's un-normed output -> the next step's hidden input: as is (EAGLE-3), or
        normed by ``norm`` (EAGLE 3.1's ``norm_output``), the state its logits read."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).to(self.dtype)  # (B, T, H)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             attend: AttendFn) -> torch.Tensor:
        """One draft step: tokens (B, T), hidden (B, T, H), RoPE positions (B, T) -> (B, T, H).

        ``attend`` decides which keys each query sees (causal prefix, chain, KV cache).
        """
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        q, k, v = self.midlayer.qkv(self.embed(input_ids), hidden, cos, sin)
        return self.midlayer.finish(hidden, attend(q, k, v))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(…, H) un-normed hidden -> (…, Vd) draft-vocab logits."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (``i + d2t[i]``)."""
        return draft_ids + self.d2t[draft_ids]

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 over right-padded sequences: position t reads aux state t and token
        ``input_ids[:, t]`` (already the NEXT token, x_{t+1}) at RoPE position t.

        Returns ``(hidden (B, T, H), logits (B, T, Vd))``. Training uses :mod:`ttt` instead.
        """
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        n_rep = self.config.num_attention_heads // self.config.num_key_value_heads

        def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                                  is_causal=True, scale=self.scale)

        hidden = self.step(input_ids, self.project(aux_hidden), positions, causal)
        return hidden, self.compute_logits(hidden)

    # -- checkpoint views --------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the tensors SGLang loads (:func:`exported_names`), detached."""
        state, names = self.state_dict(), exported_names(self.config)
        missing, extra = set(names) - set(state), set(state) - set(names)
        if missing or extra:
            raise RuntimeError(f"drafter state dict drifted from SGLang's names: missing "
                               f"{sorted(missing)}, unexpected {sorted(extra)}")
        return {name: state[name].detach() for name in names}


def _init_weights(module: nn.Module) -> None:
    # Llama's initializer_range; RMSNorm weights start at one.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``d2t``/``t2d`` describe the same ascending id set."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"d2t must be (Vd,) int64, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be (V,) bool, got {t2d.dtype} {tuple(t2d.shape)}")
    used = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    if not torch.equal(used, t2d.nonzero().flatten()):
        raise ValueError("d2t and t2d disagree (d2t must map draft ids to the ascending "
                         "target ids where t2d is True)")
