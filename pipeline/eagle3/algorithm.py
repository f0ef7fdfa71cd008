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
from pipeline.eagle3.config import SGLANG_ARCHITECTURE, DrafterConfig
from pipeline.eagle3.spec import SpecParams

# The model code (torch) is imported when first needed, never by loading the registry.


def _build(*args: Any, **kw: Any) -> Any:
    from pipeline.eagle3.model import Eagle3Drafter

    return Eagle3Drafter(*args, **kw)


def _is_model(obj: object) -> bool:
    model = sys.modules.get("pipeline.eagle3.model")  # not imported: obj cannot be one
    return model is not None and isinstance(obj, model.Eagle3Drafter)


def _load(*args: Any, **kw: Any) -> Any:
    from pipeline.eagle3.export import load_drafter

    return load_drafter(*args, **kw)


def _format_errors(directory: Any) -> tuple[str, ...]:
    from pipeline.eagle3.format_check import drafter_format_errors

    return drafter_format_errors(directory)


def _proposer(model: Any) -> Any:
    from pipeline.eagle3.proposer import Eagle3Proposer

    return Eagle3Proposer(model)


def _vllm_settings(settings: SpecParams) -> dict[str, Any]:
    if settings.eagle_topk != 1:
        raise ValueError(f"eagle_topk {settings.eagle_topk}: vLLM drafts EAGLE-3 as a chain "
                         "only; serve it with eagle_topk 1")
    return {"num_speculative_tokens": settings.num_steps}


V31_KEYS = ("fc_norm", "use_aux_norm", "norm_output")  # use_aux_norm: SGLang's other name


def _is_31(config: Mapping[str, Any]) -> bool:
    return any(config.get(k) is True for k in V31_KEYS)


def _new_31_config(target: Any, **kw: Any) -> DrafterConfig:
    return replace(DrafterConfig.from_target(target, **kw), fc_norm=True, norm_output=True)


EAGLE3 = DrafterAlgorithm(
    name="eagle3", title="EAGLE-3", architectures=(SGLANG_ARCHITECTURE,),
    claims=lambda config: not _is_31(config),
    sglang_algorithm="EAGLE3", vllm_method="eagle3", build=_build, is_model=_is_model,
    new_config=DrafterConfig.from_target,
    load=_load, format_errors=_format_errors, proposer=_proposer,
    sglang_settings=lambda settings: tuple(settings.sglang_args()),
    vllm_settings=_vllm_settings)

EAGLE31 = replace(EAGLE3, name="eagle3.1", title="EAGLE 3.1", claims=_is_31,
                  new_config=_new_31_config)
