"""EAGLE-3 drafter: vocab mapping, model, training-time test (TTT), reference drafting, export.

Training entry point: :func:`pipeline.eagle3.ttt.ttt_loss` on a :class:`~pipeline.eagle3.ttt.
TTTBatch`; the model is :class:`~pipeline.eagle3.model.Eagle3Drafter` built from a
:class:`~pipeline.eagle3.config.DrafterConfig`; :mod:`pipeline.eagle3.export` writes and reads
the SGLang checkpoint directory.
"""
