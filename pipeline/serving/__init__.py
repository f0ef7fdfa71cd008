"""Serving stage: how a promoted drafter reaches the SGLang servers that generate rollouts.

- :mod:`~pipeline.serving.contracts`: speculative settings, targets, serving manifests.
- :mod:`~pipeline.serving.ledger`: versioned manifests + ``current.json`` in storage, and
  the reader a rollout launcher calls at weight sync.
- :mod:`~pipeline.serving.backend`: the backend protocol and the ``manifest`` mode.
- :mod:`~pipeline.serving.restart`: the ``sglang-restart`` command hook.
- :mod:`~pipeline.serving.hotswap`: the ``sglang-hotswap`` client (refuses without a payload
  encoder; see its docstring).
"""
