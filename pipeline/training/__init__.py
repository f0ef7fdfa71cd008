"""Drafter training: the window's vocab, a streaming reader, the DeepSpeed loop and resume.

Flow (DESIGN §2): ``vocab_stage`` picks the draft vocabulary of a refresh step's window;
``refresh`` launches ``run`` (one process, or N under torchrun / the DeepSpeed launcher) which
runs :func:`pipeline.training.loop.train`: :mod:`data` streams the window's shards with
teacher targets, :mod:`engine_state` + :mod:`checkpoint` make it resumable without pickle, and
the drafter is exported in SGLang's format and published under ``drafters/step=NNNNNN/``.
"""
