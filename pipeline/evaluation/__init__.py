"""Acceptance evaluation: SGLang-style EAGLE-3 speculative decoding in plain torch.

Stage 6, ``acceptance_eval``: :mod:`.stage` ``run`` measures candidate, champion and no
drafter on the held-out prompts of a refresh step, as :class:`.config.EvalConfig` says
(torch-free: the run config mirrors it).

Engine: :func:`.engine.evaluate` (target HF model, drafter or None, prompts, :class:`SpecParams`,
sampler, seed) -> ``(AcceptanceStats, outputs)``. See :mod:`.engine` for the algorithm,
:mod:`.sampling` for verification at temperature > 0, :mod:`.metrics` for the definitions
of τ and α_k and :mod:`.confidence` for their intervals.
"""
