"""Deprecated alias: import :class:`SnapshotWriter` from :mod:`pipeline.snapshot.writer`."""

import warnings

from pipeline.snapshot.writer import SnapshotWriter

__all__ = ["SnapshotWriter"]

warnings.warn("pipeline.data.rollouts is deprecated: import SnapshotWriter from "
              "pipeline.snapshot.writer", DeprecationWarning, stacklevel=2)
