"""Tiny random drafters and batches for the EAGLE-3 tests (fp32, seeded)."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import LlamaConfig

from pipeline.eagle3.config import DrafterConfig, DrafterShape
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.ttt_batch import TTTBatch
from pipeline.vocab.mapping import build_vocab_mapping
from tests.families import tiny_llama_config

TARGET_VOCAB = 48
DRAFT_VOCAB = 24


def tiny_target_config(**overrides) -> LlamaConfig:
    return tiny_llama_config(vocab=TARGET_VOCAB, hidden=32, layers=8, intermediate=48,
                             **{"rms_norm_eps": 1e-6, **overrides})


def tiny_drafter(seed: int = 0, *, target: LlamaConfig | None = None,
                 draft_vocab_size: int = DRAFT_VOCAB,
                 shape: DrafterShape | None = None, v31: bool = False) -> Eagle3Drafter:
    """A drafter whose weights are large enough that attention is far from uniform.

    With Llama's 0.02 init every attention is nearly uniform, and a wrong mask or position
    barely moves the output; these weights make such bugs show up at O(1). ``shape``: its
    widths (a narrower one projects the random target embedding onto its own); ``v31``:
    EAGLE 3.1 (``fc_norm`` and ``norm_output``).
    """
    target = target or tiny_target_config()
    cfg = DrafterConfig.from_target(target, draft_vocab_size=draft_vocab_size,
                                    shape=shape or DrafterShape())
    if v31:
        cfg = replace(cfg, fc_norm=True, norm_output=True)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g)
    model = Eagle3Drafter(cfg, embed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # every norm weight, fc_norm.{i} included
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=g))
            else:
                fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))
    counts = torch.randint(0, 20, (cfg.vocab_size,), generator=g)
    mapping = build_vocab_mapping(counts, cfg.draft_vocab_size)
    model.set_vocab(mapping.d2t, mapping.t2d)
    return model


def random_batch(model: Eagle3Drafter, lengths: list[int], seed: int = 1, *,
                 response_start: int | None = None) -> TTTBatch:
    """Right-padded batch; loss mask random (or on from ``response_start``), off on padding.

    Teacher argmaxes are drawn so that about a quarter fall outside the draft vocab.
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    real = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    input_ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g) * real
    aux = torch.randn(b, t, cfg.fc_in_features, generator=g)
    logits = 2.0 * torch.randn(b, t, cfg.draft_vocab_size, generator=g)
    draft_targets = model.to_target_ids(logits.argmax(-1))
    outside = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    argmax = torch.where(torch.rand(b, t, generator=g) < 0.75, draft_targets, outside)
    if response_start is None:
        loss_mask = torch.rand(b, t, generator=g) < 0.7
    else:
        loss_mask = torch.arange(t)[None, :].expand(b, t) >= response_start
    return TTTBatch(input_ids=input_ids, aux_hidden=aux, target_logits_draft=logits,
                    target_argmax=argmax, loss_mask=loss_mask & real, attention_mask=real)
