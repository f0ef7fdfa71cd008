"""Deprecated alias: import the serving readers from :mod:`pipeline.serving_now`."""

import warnings

from pipeline.serving_now import ServingLaunch, read_serving, resolve_serving

__all__ = ["ServingLaunch", "read_serving", "resolve_serving"]

warnings.warn("pipeline.serving.ledger is deprecated: import resolve_serving and read_serving "
              "from pipeline.serving_now", DeprecationWarning, stacklevel=2)
