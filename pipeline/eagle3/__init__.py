"""EAGLE-3 drafter library (foundation: shared by training and evaluation, imports no stage).

:mod:`.algorithm` registers it in the drafter-algorithm seam (:mod:`pipeline.drafters`).

- :mod:`.config`: :class:`~.config.DrafterConfig` (SGLang's config.json) and the default aux
  layer ids; :mod:`.spec`: :class:`~.spec.SpecParams`, the speculative settings evaluation
  measures with and serving runs.
- :mod:`.model`: :class:`~.model.Eagle3Drafter` and the d2t/t2d buffer contract.
- :mod:`.ttt_batch` (batch + teacher), :mod:`.chain_attention` (the chain's attention
  kernel), :mod:`.ttt` (training-time test forward and :func:`~.ttt.ttt_loss`).
- :mod:`.drafting`: step-by-step drafting with a KV cache (the reference TTT is tested on).
- :mod:`.export`: the SGLang checkpoint directory, written and read; :mod:`.format_check`:
  every reason a directory would not load as SGLang reads it.
- :mod:`.proposer`: the model run as SGLang drafts with it, for the in-process engine.
"""
