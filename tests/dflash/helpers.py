"""Tiny random DFlash drafters for the DFlash tests (fp32, seeded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from pipeline.dflash.config import DFlashConfig
from pipeline.dflash.model import DFlashDrafter
from tests.families import tiny_llama_config

VOCAB = 48


def tiny_target_config(**overrides) -> LlamaConfig:
    return tiny_llama_config(vocab=VOCAB, hidden=32, layers=8, intermediate=48,
                             **{"rms_norm_eps": 1e-6, **overrides})


def tiny_dflash(seed: int = 0, *, target: LlamaConfig | None = None, layers: int = 2,
                block_size: int = 4, embed: torch.Tensor | None = None,
                head: torch.Tensor | None = None) -> DFlashDrafter:
    """A DFlash drafter whose weights are large enough that attention is far from uniform,
    so a wrong mask or position moves its output at O(1); on a random target embedding and
    head unless given."""
    target = target or tiny_target_config()
    cfg = DFlashConfig.from_target(target, layers=layers, block_size=block_size)
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.vocab_size, cfg.hidden_size)
    embed = torch.randn(shape, generator=g) if embed is None else embed
    head = torch.randn(shape, generator=g) if head is None else head
    model = DFlashDrafter(cfg, embed, head)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[-1] ** 0.5))
    return model.eval()
