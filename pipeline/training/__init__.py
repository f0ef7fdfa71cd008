"""Stage 5, ``drafter_checkpoint``: train a refresh step's drafter and publish it.

:mod:`.stage` ``run`` plans the run (the vocab stage's window and mapping, the warm start from
the drafter serving now) and launches :mod:`.worker` (one process, or N under torchrun / the
DeepSpeed launcher, :mod:`.launch`), which runs :func:`pipeline.training.loop.train`:
:mod:`.data` streams the window's shards with teacher targets, :mod:`.engine_state` +
:mod:`.checkpoint` make it resumable without pickle, and the drafter is exported in SGLang's
format and published under ``drafters/step=NNNNNN/``.
"""
