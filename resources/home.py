"""Where the embedded default keeps its state: one directory, movable by ``AERIE_HOME``.

Layout under the home:

- ``storage/``: the storage root (unless ``AERIE_STORAGE_URL`` says otherwise);
- ``training/``: resumable training work dirs (pickle-free checkpoints, completeness markers);
- ``cache/``: verified local copies of committed policies and drafters, named by content
  (bounded by ``AERIE_CACHE_MAX_GB``);
- ``serving-cache/``: local drafter copies of the restart and reload serving modes;
- ``dagster/``: ``DAGSTER_HOME`` (SQLite run and event storage);
- ``mlflow/``: MLflow tracking and registry (``mlflow.db``), artifacts, promotion lock files;
- ``demo-world/``: the demo RL trainer's work dir and ``world.json`` (its report).
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def aerie_home() -> Path:
    """``$AERIE_HOME`` if set, else ``.aerie/`` in the checkout."""
    return Path(os.environ.get("AERIE_HOME") or CHECKOUT / ".aerie").resolve()


def default_storage_url() -> str:
    return (aerie_home() / "storage").as_uri()


def dagster_home() -> Path:
    return aerie_home() / "dagster"
