"""A tiny RL world in storage for the training tests: policy, tokenized rollouts, shards.

A random 4-layer Llama (H=32, V=300, a deliberately peaky lm_head so the teacher has
something to teach) is published as the policy of every step; each step gets tokenized
samples (prompt unmasked, response masked) and hidden-state shards captured by the real hf
backend through ``capture.stage.run`` — the production path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM

from pipeline.capture import stage as capture_stage
from pipeline.capture.config import ExtractConfig
from pipeline.capture.hf import HFCaptureBackend
from pipeline.snapshot.policy import load_policy_ref, publish_policy
from pipeline.storage import Storage
from tests.capture.helpers import write_rows
from tests.families import tiny_llama

VOCAB = 300
HIDDEN = 32
LAYERS = 4
STATE_BYTES = 2 * 4 * HIDDEN  # bf16 aux (3H) + final (H) per token
# a few row groups per shard, a few shards per step
EXTRACT = ExtractConfig(token_budget=256, max_batch_size=8, shard_bytes=400 * STATE_BYTES,
                        row_group_bytes=120 * STATE_BYTES, heldout_fraction=0.0)


def tiny_target(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    model = tiny_llama(seed, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, intermediate=64,
                       max_positions=128, tie_word_embeddings=tie)
    if not tie:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.5)  # confident teacher: logits std ~3
    return model


def write_tokenized(storage: Storage, step: int, n: int, seed: int,
                    lengths: tuple[int, int] = (16, 48), rows_per_part: int = 16) -> list[dict]:
    """``n`` samples: random ids from a skewed distribution, mask on from a random start."""
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, VOCAB + 1) ** 1.1  # Zipf-like: a few ids dominate
    probs /= probs.sum()
    rows = []
    for i in range(n):
        t = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = rng.choice(VOCAB, size=t, p=probs)
        start = int(rng.integers(2, t // 2))
        rows.append({"sample_id": f"s{step}-{i}", "step": step, "input_ids": ids.tolist(),
                     "loss_mask": [int(j >= start) for j in range(t)]})
    return write_rows(storage, step, rows, rows_per_part)


def build_world(root: Path, steps: Sequence[int] = (1, 2, 3), samples: int = 32,
                model: LlamaForCausalLM | None = None, extract: ExtractConfig = EXTRACT,
                aux_layer_ids: Sequence[int] | None = None) -> Storage:
    """Policy + tokenized + shards for ``steps`` under ``root`` (a file:// storage), the
    states of ``aux_layer_ids`` captured (None: EAGLE-3's default layers)."""
    storage = Storage(root.as_uri())
    model = model or tiny_target()
    policy_dir = root.parent / f"{root.name}-policy"
    model.save_pretrained(policy_dir)
    backend = HFCaptureBackend(model, token_budget=extract.token_budget,
                               aux_layer_ids=aux_layer_ids)
    for step in steps:
        publish_policy(storage, step, policy_dir)
        write_tokenized(storage, step, samples, seed=step)
        capture_stage.run(storage, step, backend, extract, policy=load_policy_ref(storage, step))
    return storage
