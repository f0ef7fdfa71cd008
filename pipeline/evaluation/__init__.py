"""Acceptance evaluation: SGLang-style EAGLE-3 speculative decoding in plain torch.

Entry point: :func:`evaluate` (target HF model, drafter or None, prompts, :class:`SpecParams`)
-> ``(AcceptanceStats, outputs)``. See :mod:`.engine` for the algorithm and
:mod:`.metrics` for the definitions of τ and α_k.
"""

from pipeline.evaluation.drafter import Drafter, as_drafter
from pipeline.evaluation.engine import CycleTrace, EvalRun, evaluate, generate
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.spec import SpecParams

__all__ = ["AcceptanceStats", "CycleTrace", "Drafter", "EvalRun", "SpecParams", "as_drafter",
           "evaluate", "generate"]
