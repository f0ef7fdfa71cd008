"""Drafters and flags for the contract server's speculative endpoints: a real EAGLE-3
checkpoint that drafts well for the contract's tiny Llama, and the server flags that load it."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.export import save_drafter
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.vocab.mapping import build_vocab_mapping

MAX_NEW = 20
DRAFT_VOCAB = 64
CHAIN = SpecParams(3, 1, 4)


def spec_flags(params: SpecParams, drafter: Path, interval: int = 1) -> dict:
    """The speculative server flags that load ``drafter`` with ``params``."""
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(drafter),
            "speculative_num_steps": params.num_steps, "speculative_eagle_topk": params.eagle_topk,
            "speculative_num_draft_tokens": params.num_draft_tokens,
            "decode_log_interval": interval}


def save_copy_drafter(target: torch.nn.Module, directory: Path, outputs: list[list[int]],
                      draft_vocab: int = DRAFT_VOCAB, noise: float = 0.0) -> Path:
    """A real EAGLE-3 checkpoint whose drafts are often right: ``fc`` passes the output of
    the target's second-to-last layer through, attention and MLP add nothing, and
    ``norm``/``lm_head`` are the target's (rows of the draft vocab). So it proposes the
    target's top choices at the previous position, which a tiny random Llama, repeating
    itself, often confirms. The draft vocab (``draft_vocab`` ids, a real d2t/t2d) holds the
    tokens the target emits most in ``outputs``. ``noise`` (in units of the head's standard
    deviation, seeded) blurs its head: the larger, the worse it drafts."""
    config = target.config
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    aux = (1, 3, layers - 2) if layers >= 8 else (0, 1, layers - 2)
    cfg = DrafterConfig.from_target(config, draft_vocab_size=draft_vocab, aux_layer_ids=aux)
    counts = torch.bincount(torch.tensor([t for o in outputs for t in o]), minlength=vocab)
    mapping = build_vocab_mapping(counts, draft_vocab)
    model = Eagle3Drafter(cfg, target.get_input_embeddings().weight.detach())
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * hidden:] = torch.eye(hidden)  # (H, 3H): the last aux slot
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
        model.norm.weight.copy_(target.model.norm.weight)
        model.set_vocab(mapping.d2t, mapping.t2d)
        model.lm_head.weight.copy_(target.lm_head.weight[mapping.t2d])
        head = model.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
                  * head.std() * noise)
    return save_drafter(model, cfg, directory, dtype=torch.float32)


def save_copy_dflash(target: torch.nn.Module, directory: Path, block_size: int = 4) -> Path:
    """A real DFlash checkpoint that proposes its anchor (the last verified token) at every
    slot, which a target repeating its last token confirms: one layer whose attention is
    uniform (q, k = 0) and whose values keep the anchor's normed embedding but drop the mask
    token's (``v_proj`` projects the mask's direction out; the context is 0 with ``fc`` = 0),
    scaled up by ``o_proj`` so the slot's state points at the anchor's embedding, which the
    target's tied head then ranks first."""
    from pipeline.dflash.config import DFlashConfig
    from pipeline.dflash.export import save_drafter as save_dflash
    from pipeline.dflash.model import DFlashDrafter
    from pipeline.eagle3.config import DrafterShape

    config = target.config
    heads = config.num_attention_heads
    cfg = DFlashConfig.from_target(config, layers=1, block_size=block_size,
                                   shape=DrafterShape(num_key_value_heads=heads))
    embed = target.get_input_embeddings().weight.detach()
    model = DFlashDrafter(cfg, embed, target.get_output_embeddings().weight.detach())
    layer, h = model.layers[0], cfg.hidden_size
    with torch.no_grad():
        for p in model.parameters():
            p.zero_() if p.dim() == 2 else p.fill_(1.0)  # matrices 0, norms 1
        mask = layer.input_layernorm(embed[cfg.mask_token_id].float())
        u = mask / mask.norm()
        layer.self_attn.v_proj.weight.copy_(torch.eye(h) - torch.outer(u, u))
        layer.self_attn.o_proj.weight.copy_(torch.eye(h) * 1000.0)
    return save_dflash(model, directory, dtype=torch.float32, overwrite=True)
