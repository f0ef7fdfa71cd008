"""The drafter's wiring against an explicit formula and transformers' Llama building blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.model import EXPORTED_NAMES, Eagle3Drafter, RMSNorm, RotaryEmbedding
from tests.eagle3.helpers import tiny_drafter, tiny_target_config


def rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def explicit_step0(model: Eagle3Drafter, tokens: torch.Tensor, aux: torch.Tensor):
    """DESIGN §4 written out for one sequence, with transformers' RoPE: (T, H), (T, Vd)."""
    cfg, sd = model.config, model.state_dict()
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.head_dim
    t = tokens.shape[0]
    h = aux @ sd["fc.weight"].T  # (T, H)
    e = model.embed_tokens.weight[tokens]  # (T, H)
    x = torch.cat([rms(e, sd["midlayer.input_layernorm.weight"], eps),
                   rms(h, sd["midlayer.hidden_norm.weight"], eps)], dim=-1)  # embedding first
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, nh, d).transpose(0, 1)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, d).transpose(0, 1)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, d).transpose(0, 1)
    hf_cfg = tiny_target_config(num_attention_heads=nh, num_key_value_heads=nkv)
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, torch.arange(t)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    q, k = q[0], k[0]
    heads = []
    for j in range(nh):
        s = (q[j] @ k[j // (nh // nkv)].T) / d ** 0.5  # (T, T)
        s = s.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        heads.append(torch.softmax(s, -1) @ v[j // (nh // nkv)])
    attn = torch.cat(heads, dim=-1) @ sd["midlayer.self_attn.o_proj.weight"].T
    h1 = h + attn  # residual = the hidden input (SGLang: residual = hidden_states)
    y = rms(h1, sd["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(y @ sd["midlayer.mlp.gate_proj.weight"].T)
           * (y @ sd["midlayer.mlp.up_proj.weight"].T)) @ sd["midlayer.mlp.down_proj.weight"].T
    h2 = h1 + mlp
    return h2, rms(h2, sd["norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("t", [1, 6])
def test_step0_matches_explicit_formula(t):
    model = tiny_drafter(21)
    g = torch.Generator().manual_seed(t)
    tokens = torch.randint(0, model.config.vocab_size, (t,), generator=g)
    aux = torch.randn(t, model.config.fc_in_features, generator=g)
    with torch.no_grad():
        hidden, logits = model(tokens[None], aux[None])
    ref_hidden, ref_logits = explicit_step0(model, tokens, aux)
    torch.testing.assert_close(hidden[0], ref_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=1e-5)


def test_parameter_names_and_shapes_are_sglangs():
    model = tiny_drafter(22)
    cfg = model.config
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    expected = {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    state = model.state_dict()
    assert set(expected) == set(EXPORTED_NAMES) == set(state)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
     "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},  # Gemma-3's global layers
    "longrope",
])
@pytest.mark.parametrize("positions", [[0, 1, 5, 63, 64, 200, 255], [0, 3, 62, 63]],
                         ids=["past-64", "below-64"])
def test_rope_matches_transformers(rope, positions):
    """Every rope type the drafter takes, as transformers' Llama rotates. longrope (Phi-3)
    switches to its long factors for a whole pass once a position reaches the original
    length (64 here), and stays on the short ones below it."""
    if rope == "longrope":
        half = tiny_target_config().head_dim // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.5] * half,
                "long_factor": [float(i + 2) for i in range(half)],
                "original_max_position_embeddings": 64}
    target = tiny_target_config(rope_parameters=rope)
    cfg = DrafterConfig.from_target(target)
    assert cfg.rope_type == rope["rope_type"]
    positions = torch.tensor([positions])
    x = torch.randn(1, cfg.num_attention_heads, positions.shape[1], cfg.head_dim)
    hf_cos, hf_sin = LlamaRotaryEmbedding(target)(x, positions)
    cos, sin = RotaryEmbedding(cfg).cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)


def test_rope_frequencies_survive_a_bf16_cast():
    model = tiny_drafter(23).to(torch.bfloat16)
    assert model.rope.inv_freq.dtype == torch.float32
    assert model.fc.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.t2d.dtype == torch.bool and model.d2t.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    x = torch.randn(3, 5, 32).to(dtype)
    ours, theirs = RMSNorm(32, 1e-6), LlamaRMSNorm(32, 1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_embedding_is_frozen_and_not_saved():
    model = tiny_drafter(24)
    assert "embed_tokens.weight" not in model.state_dict()
    assert not any("embed" in name for name, _ in model.named_parameters())
    assert not model.embed_tokens.weight.requires_grad
    assert len(model.trainable_parameters()) == len(EXPORTED_NAMES) - 2


def test_constructor_and_set_vocab_validate():
    model = tiny_drafter(25)
    cfg = model.config
    with pytest.raises(ValueError, match="embedding"):
        Eagle3Drafter(cfg, torch.zeros(cfg.vocab_size + 1, cfg.hidden_size))
    bad_t2d = model.t2d.clone()
    bad_t2d[bad_t2d.nonzero()[0]] = False
    bad_t2d[(~model.t2d).nonzero()[0]] = True
    with pytest.raises(ValueError, match="disagree"):
        model.set_vocab(model.d2t, bad_t2d)
    ids = torch.arange(cfg.draft_vocab_size)
    assert torch.equal(model.to_target_ids(ids), model.t2d.nonzero().flatten())
