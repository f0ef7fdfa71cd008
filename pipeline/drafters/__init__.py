"""The drafter-algorithm seam (foundation): what every drafter algorithm provides.

- :mod:`.algorithm`: :class:`~.algorithm.DrafterAlgorithm`, the record an algorithm
  registers once (in :mod:`pipeline.algorithms`): its names in SGLang and vLLM, the model it
  trains and decodes with, how its export is loaded and format-checked, its serving flags
  and the proposer the in-process evaluator drives.
- :mod:`.protocol`: the :class:`~.protocol.Drafter` protocol that proposer implements, and
  the :class:`~.protocol.CandidateTree` a cycle's draft candidates are kept in.
"""
