"""EAGLE-3's registration in the drafter-algorithm seam (:mod:`pipeline.drafters.algorithm`).

SGLang serves it with ``--speculative-algorithm EAGLE3`` and the three tree settings of
:class:`~pipeline.eagle3.spec.SpecParams`; vLLM (0.33) with ``method: eagle3``, drafting a
chain of ``num_speculative_tokens``, so only ``eagle_topk`` 1 has an equivalent there.
"""

from __future__ import annotations

from typing import Any

from pipeline.drafters.algorithm import DrafterAlgorithm
from pipeline.eagle3.config import SGLANG_ARCHITECTURE
from pipeline.eagle3.export import load_drafter
from pipeline.eagle3.format_check import drafter_format_errors
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.proposer import Eagle3Proposer
from pipeline.eagle3.spec import SpecParams


def _vllm_settings(settings: SpecParams) -> dict[str, Any]:
    if settings.eagle_topk != 1:
        raise ValueError(f"eagle_topk {settings.eagle_topk}: vLLM drafts EAGLE-3 as a chain "
                         "only; serve it with eagle_topk 1")
    return {"num_speculative_tokens": settings.num_steps}


EAGLE3 = DrafterAlgorithm(
    name="eagle3", title="EAGLE-3", architectures=(SGLANG_ARCHITECTURE,),
    sglang_algorithm="EAGLE3", vllm_method="eagle3", model=Eagle3Drafter,
    load=load_drafter, format_errors=drafter_format_errors, proposer=Eagle3Proposer,
    sglang_settings=lambda settings: tuple(settings.sglang_args()),
    vllm_settings=_vllm_settings)
