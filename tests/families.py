"""The tests' one source of tiny random models: :func:`tiny_llama` (a Llama of any toy
shape, the tests' default target) and :func:`tiny_target` (each family people train with RL).

Each keeps its family's distinguishing structure at toy width (hidden 64, 4 layers; 5 for
DeepSeek, whose aux ids start at 1): the rope type, tied embeddings, the vocabulary size
where it matters (Qwen3's 151,936), MoE routing, MLA, sliding-window and hybrid attention
(windows of 8 tokens, shorter than the test sequences), Gemma's soft-caps and GPT-OSS's
attention sinks. Built through ``AutoModelForCausalLM.from_config`` exactly as a checkpoint
of that family loads.

Every test that needs a tiny random model builds it here, so that a change of how models are
made (seeding, dtype, eval mode) happens once.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf
from transformers import AutoModelForCausalLM, PreTrainedModel

WINDOW = 8  # sliding window of the windowed families: test sequences run well past it
VOCAB = 512

_SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                              max_position_embeddings=4096, initializer_range=0.1,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def _configs() -> dict[str, tf.PretrainedConfig]:
    s = _SHAPE
    return {
        "llama3": tf.LlamaConfig(**s, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "qwen2_tied": tf.Qwen2Config(**s, tie_word_embeddings=True),
        "qwen3_big_vocab": tf.Qwen3Config(**{**s, "vocab_size": 151936}, head_dim=16),
        "qwen3_moe": tf.Qwen3MoeConfig(**s, **_MOE, num_experts=4, head_dim=16),
        "mistral_window": tf.MistralConfig(**s, sliding_window=WINDOW),
        "gemma2": tf.Gemma2Config(**s, head_dim=16, sliding_window=WINDOW),
        "gemma3": tf.Gemma3TextConfig(**s, head_dim=16, sliding_window=WINDOW,
                                      sliding_window_pattern=2),
        "phi3_longrope": tf.Phi3Config(**{**s, "num_key_value_heads": 4}, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8, "original_max_position_embeddings": 256},
            original_max_position_embeddings=256),
        "deepseek_v3": tf.DeepseekV3Config(
            **{**s, "num_key_value_heads": 4, "num_hidden_layers": 5}, **_MOE,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_routed_experts=4,
            first_k_dense_replace=1, n_group=1, topk_group=1),
        "gpt_oss": tf.GptOssConfig(**s, head_dim=16, sliding_window=WINDOW,
                                   num_local_experts=4, num_experts_per_tok=2),
    }


FAMILIES = tuple(_configs())


def tiny_target(family: str, seed: int = 0) -> PreTrainedModel:
    """A random fp32 target of ``family`` (its config names its architecture, as a
    checkpoint's does)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[family], dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    return model.eval()


def tiny_llama_config(*, vocab: int, hidden: int, layers: int, intermediate: int | None = None,
                      heads: int = 4, kv_heads: int = 2, max_positions: int = 256,
                      **extra: Any) -> tf.LlamaConfig:
    """A toy Llama config (``intermediate``: 2 × ``hidden`` unless given); ``extra``: any
    other ``LlamaConfig`` argument, by its own name, over the ones above."""
    return tf.LlamaConfig(**{
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions, **extra})


def tiny_llama(seed: int = 0, config: tf.LlamaConfig | None = None,
               **shape: Any) -> tf.LlamaForCausalLM:
    """A random fp32 ``LlamaForCausalLM`` in eval mode, initialised under ``seed``: of
    ``config``, or of :func:`tiny_llama_config` ``(**shape)``."""
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config or tiny_llama_config(**shape)).eval()
