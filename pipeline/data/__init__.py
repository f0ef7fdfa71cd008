"""Deprecated: the old home of the data stages (now :mod:`pipeline.snapshot`,
:mod:`pipeline.tokenize` and :mod:`pipeline.capture`). Only the trainer-facing import of
earlier releases is kept, in :mod:`pipeline.data.rollouts`; it will be removed."""
