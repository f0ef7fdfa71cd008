"""EAGLE-3 and EAGLE 3.1 in the drafter-algorithm seam (:mod:`pipeline.drafters.algorithm`).

SGLang serves both with ``--speculative-algorithm EAGLE3`` and the three tree settings of
:class:`~pipeline.eagle3.spec.SpecParams`; vLLM (0.33) with ``method: eagle3``, drafting a
chain of ``num_speculative_tokens``, so only ``eagle_topk`` 1 has an equivalent there.

EAGLE 3.1, as Aerie writes it, is EAGLE-3 with both of the keys SGLang 0.5.23 and vLLM 0.33
read: ``fc_norm`` (an RMSNorm over each aux state before ``fc``) and ``norm_output`` (the
normed output fed back as the next step's hidden). An export with either key set is 3.1;
with neither it is EAGLE-3. Other variants called "3.1" (``norm_before_fc``,
``norm_before_residual``) are refused when read
(:data:`~pipeline.eagle3.config.UNSUPPORTED_VARIANTS`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pipeline.drafters.algorithm import DrafterAlgorithm
from pipeline.eagle3.aux_layers import default_aux_layer_ids
from pipeline.eagle3.config import SGLANG_ARCHITECTURE, DrafterConfig
from pipeline.eagle3.spec import SpecParams

# The model code (torch) is imported when first needed, never by loading the registry.


def _build(config: DrafterConfig, embed: Any, *, head: Any = None, d2t: Any = None,
           t2d: Any = None) -> Any:
    from pipeline.eagle3.model import Eagle3Drafter

    return Eagle3Drafter(config, embed, d2t=d2t, t2d=t2d)  # its own head: not the target's


def _is_model(obj: object) -> bool:
    model = sys.modules.get("pipeline.eagle3.model")  # not imported: obj cannot be one
    return model is not None and isinstance(obj, model.Eagle3Drafter)


def _load(directory: Any, embed: Any, *, head: Any = None, **kw: Any) -> Any:
    from pipeline.eagle3.export import load_drafter

    return load_drafter(directory, embed, **kw)


def _format_errors(directory: Any) -> tuple[str, ...]:
    from pipeline.eagle3.format_check import drafter_format_errors

    return drafter_format_errors(directory)


def _proposer(model: Any) -> Any:
    from pipeline.eagle3.proposer import Eagle3Proposer

    return Eagle3Proposer(model)


def _objective(model: Any, train: Any) -> Any:
    from pipeline.eagle3.ttt import TTTObjective

    return TTTObjective(model, train.ttt_depth, train.ttt_decay)


def _collate(samples: Any, *, target: Any, model: Any, device: Any) -> Any:
    from pipeline.eagle3.ttt_batch import LogitHead, collate

    # the target's soft-cap / scaling after the head matmul
    return collate(samples, target.lm_head, model.t2d, device=device,
                   head=LogitHead.of(target.config))


def _fresh(model: Any, target: Any) -> Any:
    from pipeline.eagle3.model import Eagle3Drafter

    embed = model.embed_tokens.weight.cpu() if model.config.owns_embedding else target.embed
    return Eagle3Drafter(model.config, embed, d2t=model.d2t.cpu(), t2d=model.t2d.cpu())


def _save(model: Any, directory: Any, *, dtype: Any) -> Any:
    from pipeline.eagle3.export import save_drafter

    return save_drafter(model, model.config, directory, overwrite=True, dtype=dtype)


def _warm_start(model: Any, directory: Any, label: str) -> Any:
    from pipeline.eagle3.warm import warm_start_from

    return warm_start_from(model, directory, label)


def _new_config(target: Any, *, train: Any = None, **kw: Any) -> DrafterConfig:
    return DrafterConfig.from_target(target, **kw)


def _vllm_settings(settings: SpecParams) -> dict[str, Any]:
    if settings.eagle_topk != 1:
        raise ValueError(f"eagle_topk {settings.eagle_topk}: vLLM drafts EAGLE-3 as a chain "
                         "only; serve it with eagle_topk 1")
    return {"num_speculative_tokens": settings.num_steps}


V31_KEYS = ("fc_norm", "use_aux_norm", "norm_output")  # use_aux_norm: SGLang's other name


def _is_31(config: Mapping[str, Any]) -> bool:
    return any(config.get(k) is True for k in V31_KEYS)


def _new_31_config(target: Any, *, train: Any = None, **kw: Any) -> DrafterConfig:
    return replace(DrafterConfig.from_target(target, **kw), fc_norm=True, norm_output=True)


EAGLE3 = DrafterAlgorithm(
    name="eagle3", title="EAGLE-3", architectures=(SGLANG_ARCHITECTURE,),
    claims=lambda config: not _is_31(config),
    sglang_algorithm="EAGLE3", vllm_method="eagle3", build=_build, is_model=_is_model,
    new_config=_new_config, config_json=lambda config: config.to_sglang_config(),
    default_layer_ids=default_aux_layer_ids,
    load=_load, format_errors=_format_errors, proposer=_proposer, objective=_objective,
    collate=_collate, fresh=_fresh, save=_save, warm_start=_warm_start,
    settings_for=lambda config, settings: settings,
    sglang_reported=lambda s: (s.num_steps, s.eagle_topk, s.num_draft_tokens),
    from_sglang_reported=lambda steps, topk, tokens: SpecParams(steps, topk, tokens),
    sglang_settings=lambda settings: tuple(settings.sglang_args()),
    vllm_settings=_vllm_settings)

EAGLE31 = replace(EAGLE3, name="eagle3.1", title="EAGLE 3.1", claims=_is_31,
                  new_config=_new_31_config)
