"""DrafterConfig from target configs (transformers 5 and 4 styles) and SGLang's config.json."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import DeepseekV3Config, LlamaConfig

from pipeline.eagle3.config import DrafterConfig, DrafterShape, read_rope, shapes_match
from pipeline.records import from_json, to_json
from tests.eagle3.helpers import tiny_target_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 128}

SGLANG_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_hidden_layers", "hidden_act", "rms_norm_eps",
    "max_position_embeddings", "vocab_size", "draft_vocab_size", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings", "torch_dtype",
    "eagle_config", "eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states",
}


def test_from_transformers5_target():
    target = tiny_target_config(num_hidden_layers=12, head_dim=16,
                                rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    cfg = DrafterConfig.from_target(target, draft_vocab_size=20)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (32, 48, 4, 2, 16)
    assert cfg.aux_layer_ids == (1, 5, 8)  # [1, N//2 - 1, N - 4]
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == LLAMA3 and cfg.rope_type == "llama3"
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size) == (48, 20, 32)
    assert cfg.max_position_embeddings == 256 and cfg.rms_norm_eps == 1e-6


def test_from_transformers4_style_dict_and_caps_the_draft_vocab():
    target = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
              "num_attention_heads": 8, "vocab_size": 100, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "rope_theta": 1e6,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = DrafterConfig.from_target(target, aux_layer_ids=[0, 2, 6])
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 8
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == {"factor": 2.0, "rope_type": "linear"}
    assert cfg.draft_vocab_size == 100  # 32000 capped by the target vocab
    assert cfg.aux_layer_ids == (0, 2, 6)
    with pytest.raises(ValueError, match=r"must be in \[0, 6\]"):
        DrafterConfig.from_target(target, aux_layer_ids=[0, 7])


@pytest.mark.parametrize("mlp", [{"hidden_act": "gelu"},
                                 {"hidden_activation": "gelu_pytorch_tanh"}])  # Gemma 2/3
def test_the_drafter_is_swiglu_whatever_the_targets_mlp(mlp):
    """The EAGLE-3 drafter SGLang and vLLM run is a Llama layer with a SiLU-gated MLP; a
    GELU target's activation is neither copied (the export would not load) nor refused."""
    target = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
              "num_attention_heads": 8, "vocab_size": 100, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 1e4, **mlp}
    cfg = DrafterConfig.from_target(target)
    assert cfg.hidden_act == "silu" and cfg.to_sglang_config()["hidden_act"] == "silu"


def test_read_rope_prefers_rope_parameters_and_drops_default_scaling():
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 3.0},
                      "rope_theta": 7.0}) == (3.0, None)
    assert read_rope({"rope_theta": 7.0, "rope_scaling": None}) == (7.0, None)
    with pytest.raises(ValueError, match="rope_theta"):
        read_rope({"hidden_size": 4})


def test_sglang_config_json():
    cfg = DrafterConfig.from_target(tiny_target_config(
        rope_parameters={**LLAMA3, "rope_theta": 500000.0}), draft_vocab_size=20)
    out = cfg.to_sglang_config()
    assert set(out) == SGLANG_KEYS
    assert out["architectures"] == ["LlamaForCausalLMEagle3"]
    assert out["model_type"] == "llama" and out["num_hidden_layers"] == 1
    assert out["tie_word_embeddings"] is False and out["torch_dtype"] == "bfloat16"
    assert out["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                   "use_aux_hidden_state": True,
                                   "aux_hidden_state_capture": "layer_output"}
    assert out["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM numbers them + 1
    assert out["rope_theta"] == 500000.0  # top level, for loaders that read only that
    assert out["rope_scaling"] == LLAMA3
    assert out["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}
    assert (out["vocab_size"], out["draft_vocab_size"]) == (48, 20)
    assert "target_hidden_size" not in out
    wide = replace(cfg, target_hidden_size=64)
    assert wide.to_sglang_config()["target_hidden_size"] == 64
    assert wide.fc_in_features == 192


def test_per_layer_type_rope_gives_the_full_attention_layers_rope():
    """Gemma-3 (transformers 5): one rope per layer type; the drafter, which attends over
    the whole sequence, takes the full-attention layers'."""
    gemma3 = {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    assert read_rope(gemma3) == (1e6, {"factor": 8.0, "rope_type": "linear"})
    cfg = DrafterConfig.from_target({**tiny_target_config().to_dict(), **gemma3})
    assert cfg.to_sglang_config()["rope_scaling"] == {"factor": 8.0, "rope_type": "linear"}


@pytest.mark.parametrize(("rope", "drafter"), [
    # DeepSeek-V3: mscale/mscale_all_dim change transformers' YaRN, not the engines' Llama
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
     {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
      "beta_fast": 32, "beta_slow": 1}),
    # GPT-OSS: truncate=False is transformers-only
    ({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
      "truncate": False}, {"rope_type": "yarn", "factor": 32.0,
                           "original_max_position_embeddings": 4096}),
    # dynamic NTK: transformers rescales per length, the engines statically: plain RoPE
    ({"rope_type": "dynamic", "factor": 2.0}, None),
    # Phi-4-mini: partial rotary, factor lists for 3/4 of the head: plain RoPE
    ({"rope_type": "longrope", "partial_rotary_factor": 0.75, "short_factor": [1.0] * 3,
      "long_factor": [2.0] * 3, "original_max_position_embeddings": 64}, None),
    # Phi-3: lists that fit the (8-wide) head are kept; the partial factor 1.0 is dropped
    ({"rope_type": "longrope", "partial_rotary_factor": 1.0, "short_factor": [1.0] * 4,
      "long_factor": [2.0] * 4, "original_max_position_embeddings": 64},
     {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
      "original_max_position_embeddings": 64}),
])
def test_drafter_rope_is_one_every_engine_computes_alike(rope, drafter):
    target = tiny_target_config(rope_parameters={**rope, "rope_theta": 5e4})
    cfg = DrafterConfig.from_target(target)
    assert cfg.head_dim == 8 and cfg.rope_theta == 5e4
    assert cfg.rope_scaling == drafter


def test_drafter_width_follows_the_target_unless_its_attention_is_too_wide():
    llama = DrafterConfig.from_target(LlamaConfig(num_hidden_layers=32, num_key_value_heads=8))
    assert (llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.intermediate_size) == (4096, 32, 8, 128, 11008)
    assert not llama.owns_embedding
    # DeepSeek-V3 (MLA, 128 heads of 56): 56 heads of 128 and 8 KV heads, not 128 × 56 with
    # 128 KV heads; the width stays the target's so the embedding is shared
    v3 = DrafterConfig.from_target(DeepseekV3Config())
    assert (v3.hidden_size, v3.num_attention_heads, v3.num_key_value_heads, v3.head_dim,
            v3.intermediate_size) == (7168, 56, 8, 128, 18432)
    assert not v3.owns_embedding


def test_drafter_width_from_configuration():
    v3 = DeepseekV3Config()
    narrow = DrafterConfig.from_target(v3, shape=DrafterShape(hidden_size=4096))
    assert (narrow.hidden_size, narrow.num_attention_heads, narrow.num_key_value_heads,
            narrow.head_dim, narrow.intermediate_size) == (4096, 32, 8, 128, 10560)
    assert narrow.target_hidden_size == 7168 and narrow.fc_in_features == 3 * 7168
    assert narrow.owns_embedding
    written = narrow.to_sglang_config()
    assert written["target_hidden_size"] == 7168 and written["hidden_size"] == 4096
    assert DrafterConfig.from_sglang_config(written) == narrow
    explicit = DrafterConfig.from_target(v3, shape=DrafterShape(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128))
    assert (explicit.hidden_size, explicit.intermediate_size, explicit.num_attention_heads,
            explicit.num_key_value_heads, explicit.head_dim) == (2048, 5632, 16, 4, 128)
    for bad in ({"hidden_size": -1}, {"head_dim": True}, {"num_attention_heads": 2.0}):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            DrafterShape(**bad)
    with pytest.raises(ValueError, match="multiple"):
        DrafterConfig.from_target(v3, shape=DrafterShape(num_attention_heads=56,
                                                         num_key_value_heads=5))


def test_phi3_config_json_keeps_longrope_original_length_at_the_top_level():
    half = tiny_target_config().head_dim // 2
    phi3 = {**tiny_target_config().to_dict(), "rope_parameters": None, "rope_theta": 1e4,
            "original_max_position_embeddings": 64, "rope_scaling": {
                "type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}}
    cfg = DrafterConfig.from_target(phi3)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64
    assert DrafterConfig.from_sglang_config(cfg.to_sglang_config()) == cfg
    del phi3["original_max_position_embeddings"]
    with pytest.raises(ValueError, match="longrope needs"):
        DrafterConfig.from_target(phi3)


def test_plain_rope_writes_null_scaling():
    out = DrafterConfig.from_target(tiny_target_config()).to_sglang_config()
    assert out["rope_theta"] == 10000.0 and out["rope_scaling"] is None


def test_transformers5_reads_the_written_config_identically():
    cfg = DrafterConfig.from_target(tiny_target_config(
        rope_parameters={**LLAMA3, "rope_theta": 500000.0}))
    hf = LlamaConfig.from_dict(cfg.to_sglang_config())
    assert hf.rope_parameters == cfg.rope_parameters
    assert hf.head_dim == cfg.head_dim and hf.num_hidden_layers == 1


def test_round_trips():
    cfg = DrafterConfig.from_target(tiny_target_config(
        rope_parameters={**LLAMA3, "rope_theta": 500000.0}), draft_vocab_size=20)
    assert DrafterConfig.from_sglang_config(cfg.to_sglang_config()) == cfg
    assert from_json(DrafterConfig, to_json(cfg)) == cfg
    wide = replace(cfg, target_hidden_size=64)
    assert DrafterConfig.from_sglang_config(wide.to_sglang_config()) == wide
    with pytest.raises(ValueError, match="architectures"):
        DrafterConfig.from_sglang_config({**cfg.to_sglang_config(), "architectures": ["X"]})


def test_shapes_match():
    cfg = DrafterConfig.from_target(tiny_target_config(), draft_vocab_size=20)
    assert shapes_match(cfg, replace(cfg, aux_layer_ids=(0, 1, 2), rope_theta=5.0))
    assert not shapes_match(cfg, replace(cfg, draft_vocab_size=21))
    assert not shapes_match(cfg, replace(cfg, aux_layer_ids=(1, 2)))
    assert not shapes_match(cfg, replace(cfg, intermediate_size=64))


def test_validation():
    cfg = DrafterConfig.from_target(tiny_target_config())
    with pytest.raises(ValueError, match="draft_vocab_size"):
        replace(cfg, draft_vocab_size=cfg.vocab_size + 1)
    with pytest.raises(ValueError, match="rope type"):
        replace(cfg, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="multiple"):
        replace(cfg, num_key_value_heads=3)
