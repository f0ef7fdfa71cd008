"""Tiny fp32 models for the evaluation engine: a 2-layer Llama target, a random EAGLE-3
drafter whose draft vocab (200) is smaller than the target's (300), prompts, and a plain
cache-free greedy loop as the reference every engine output is compared against."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.evaluation.reference import greedy_reference
from pipeline.vocab.mapping import build_vocab_mapping
from tests.dflash.helpers import tiny_dflash
from tests.families import tiny_llama, tiny_llama_config

VOCAB = 300
DRAFT_VOCAB = 200
AUX_LAYER_IDS = (0,)  # a 2-layer target: only layer 0's output is in every engine's reach
MAX_NEW = 24

torch.set_num_threads(1)


def target_config() -> LlamaConfig:
    return tiny_llama_config(vocab=VOCAB, hidden=64, layers=2, max_positions=512,
                             rms_norm_eps=1e-6, initializer_range=0.1,
                             architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return tiny_llama(0, target_config())


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """20 random prompts of 1..30 tokens."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 2, 30] + torch.randint(3, 30, (17,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def references(target, prompts) -> list[list[int]]:
    """``MAX_NEW`` greedy tokens per prompt (slice for shorter runs)."""
    return [greedy_reference(target, p, MAX_NEW) for p in prompts]


def expected(references: list[list[int]], max_new: int, eos: set[int] = frozenset()
             ) -> list[list[int]]:
    """What greedy decoding emits: up to and including the first EOS, at most ``max_new``."""
    out = []
    for ref in references:
        ref = ref[:max_new]
        stop = next((i for i, t in enumerate(ref) if t in eos), None)
        out.append(ref if stop is None else ref[:stop + 1])
    return out


def random_drafter(target: LlamaForCausalLM, seed: int = 0) -> Eagle3Drafter:
    """A random drafter with O(1) weights (attention far from uniform, so a wrong mask or
    position changes its output) and a real d2t mapping (draft vocab < target vocab)."""
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=DRAFT_VOCAB,
                                    aux_layer_ids=AUX_LAYER_IDS)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(cfg, target.model.embed_tokens.weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))
    counts = torch.randint(0, 50, (cfg.vocab_size,), generator=g)
    mapping = build_vocab_mapping(counts, cfg.draft_vocab_size)
    model.set_vocab(mapping.d2t, mapping.t2d)
    return model.eval()


@pytest.fixture(scope="session")
def drafter(target) -> Eagle3Drafter:
    return random_drafter(target)


@pytest.fixture(scope="session")
def dflash(target):
    """A random DFlash drafter (block of 8) on the target's own embedding and head."""
    return tiny_dflash(0, target=target.config, block_size=8,
                       embed=target.model.embed_tokens.weight.detach(),
                       head=target.lm_head.weight.detach())
