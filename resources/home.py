"""Where the embedded default keeps its state: one directory, movable by ``AERIE_HOME``.

Layout under the home: ``storage/`` (the storage root), ``dagster/`` (``DAGSTER_HOME``),
``demo-world/`` (the demo RL trainer's work dir); later stages add their own entries.
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
