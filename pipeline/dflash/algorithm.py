"""DFlash in the drafter-algorithm seam (:mod:`pipeline.drafters.algorithm`).

SGLang serves it with ``--speculative-algorithm DFLASH`` and ``--speculative-num-draft-tokens``
= the block size (the verify window, anchor included; SGLang forces one step and top-k 1);
vLLM (0.33) with ``method: dflash`` and ``num_speculative_tokens`` = block size − 1. Both are
written from :class:`~pipeline.eagle3.spec.SpecParams`, which for DFlash must be a chain
(``eagle_topk`` 1) of ``num_steps`` = ``num_draft_tokens`` − 1 tokens. The deployment's
settings are EAGLE's: a DFlash drafter is served and measured with a chain as long as its
own block instead (``settings_for``).
"""

from __future__ import annotations

import sys
from typing import Any

from pipeline.dflash.config import ARCHITECTURE, DFlashConfig, default_target_layer_ids
from pipeline.drafters.algorithm import DrafterAlgorithm
from pipeline.eagle3.spec import SpecParams


def _build(config: DFlashConfig, embed: Any, *, head: Any = None, **_: Any) -> Any:
    from pipeline.dflash.model import DFlashDrafter

    if head is None:
        raise ValueError("a DFlash drafter drafts with the target's lm_head: pass head=")
    return DFlashDrafter(config, embed, head)


def _is_model(obj: object) -> bool:
    model = sys.modules.get("pipeline.dflash.model")
    return model is not None and isinstance(obj, model.DFlashDrafter)


def _new_config(target: Any, *, train: Any = None, draft_vocab_size: Any = None,
                **kw: Any) -> DFlashConfig:
    if train is not None:
        kw.update(layers=train.dflash_layers, block_size=train.dflash_block_size,
                  mask_token_id=train.dflash_mask_token_id
                  if train.dflash_mask_token_id >= 0 else None)
    return DFlashConfig.from_target(target, **kw)


def _load(*args: Any, **kw: Any) -> Any:
    from pipeline.dflash.export import load_drafter

    return load_drafter(*args, **kw)


def _format_errors(directory: Any) -> tuple[str, ...]:
    from pipeline.dflash.export import format_errors

    return format_errors(directory)


def _proposer(model: Any) -> Any:
    from pipeline.dflash.proposer import DFlashProposer

    return DFlashProposer(model)


def _objective(model: Any, train: Any) -> Any:
    from pipeline.dflash.objective import BlockObjective

    return BlockObjective(model, train.dflash_anchors, train.dflash_gamma, train.dflash_kd)


def _collate(samples: Any, *, target: Any, model: Any, device: Any) -> Any:
    from pipeline.dflash.objective import collate

    return collate(samples, device=device)


def _fresh(model: Any, target: Any) -> Any:
    from pipeline.dflash.model import DFlashDrafter

    return DFlashDrafter(model.config, target.embed, target.lm_head)


def _save(model: Any, directory: Any, *, dtype: Any) -> Any:
    from pipeline.dflash.export import save_drafter

    return save_drafter(model, directory, dtype=dtype, overwrite=True)


def _warm_start(model: Any, directory: Any, label: str) -> Any:
    from pipeline.dflash.export import warm_start_from

    return warm_start_from(model, directory, label)


def _settings_for(config: Any, settings: SpecParams) -> SpecParams:
    """A chain as long as the drafter's block, whatever the deployment's EAGLE settings."""
    block = DFlashConfig.from_config_json(config).block_size
    return SpecParams(num_steps=block - 1, eagle_topk=1, num_draft_tokens=block)


def _check_chain(settings: SpecParams) -> None:
    if settings.eagle_topk != 1 or settings.num_draft_tokens != settings.num_steps + 1:
        raise ValueError(f"DFlash drafts a chain: serve it with eagle_topk 1 and "
                         f"num_draft_tokens = num_steps + 1 (got {settings.num_steps}, "
                         f"{settings.eagle_topk}, {settings.num_draft_tokens})")


def _sglang_settings(settings: SpecParams) -> tuple[str, ...]:
    _check_chain(settings)
    return ("--speculative-num-draft-tokens", str(settings.num_draft_tokens))


def _vllm_settings(settings: SpecParams) -> dict[str, Any]:
    _check_chain(settings)
    return {"num_speculative_tokens": settings.num_steps}


DFLASH = DrafterAlgorithm(
    name="dflash", title="DFlash", architectures=(ARCHITECTURE,), claims=lambda config: True,
    sglang_algorithm="DFLASH", vllm_method="dflash", build=_build, is_model=_is_model,
    new_config=_new_config, config_json=lambda config: config.to_config_json(),
    default_layer_ids=lambda layers, model_type: default_target_layer_ids(layers),
    load=_load, format_errors=_format_errors, proposer=_proposer, objective=_objective,
    collate=_collate, fresh=_fresh, save=_save, warm_start=_warm_start,
    settings_for=_settings_for,
    # SGLang forces one step and top-k 1 for DFLASH; its verify window is the block
    sglang_reported=lambda s: (1, 1, s.num_draft_tokens),
    from_sglang_reported=lambda steps, topk, tokens: SpecParams(tokens - 1, 1, tokens),
    sglang_settings=_sglang_settings, vllm_settings=_vllm_settings)
