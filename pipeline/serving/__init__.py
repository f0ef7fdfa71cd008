"""Deprecated: the old home of serving (now :mod:`pipeline.release` and
:mod:`pipeline.serving_now`). Only the rollout-launcher import of earlier releases is kept,
in :mod:`pipeline.serving.ledger`; it will be removed."""
