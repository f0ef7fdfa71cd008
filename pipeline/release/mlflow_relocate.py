"""An embedded MLflow store that moved: its artifact locations follow it.

A sqlite tracking store records absolute artifact locations: the experiment's, each run's,
and each model version's source. Copy or move the directory that holds the database and its
artifacts (``$AERIE_HOME/mlflow``) and those rows still name the old place: new runs would
write there, and sources would point there. MLflow has no API to change them.

:func:`follow_moved_artifacts` compares the family's experiment with the artifact location
configured now. When they differ and the configured place already holds the experiment's
artifacts (the directory came along), it rewrites the old prefix to the new one in the
tracking and registry databases, in one transaction per database. When the configured place
does not hold them (the configuration changed, the artifacts stayed), nothing is rewritten
and the experiment keeps its location, as MLflow itself would.

Invariants:

- Only ``sqlite:`` stores and ``file:`` locations are touched; a server owns its own store.
- Only values that start with the experiment's old location (followed by ``/`` or ending
  there) change, so other experiments and non-artifact columns stay as they were.
- Idempotent: a second call, or a concurrent one, finds nothing left to rewrite.
- The only SQL on MLflow's own tables in Aerie. The tables and columns below are pinned
  against a store made by the installed MLflow (``tests/release/test_mlflow_schema.py``).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)

# the columns of MLflow's sqlite schema that hold artifact locations
TRACKING_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                    ("logged_models", "artifact_location"))
REGISTRY_COLUMNS = (("model_versions", "source"), ("model_versions", "storage_location"))


def sqlite_path(uri: str | None) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri or not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


def local_dir(location: str) -> Path | None:
    """The directory of a ``file:`` artifact location (None for any other scheme)."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(location) if not parsed.scheme and location.startswith("/") else None


def follow_moved_artifacts(tracking_uri: str, registry_uri: str | None, recorded: str,
                           configured: str) -> int:
    """Rewrite ``recorded`` (the experiment's artifact location in the store) to
    ``configured`` when the store moved with its artifacts; returns the rows rewritten."""
    recorded, configured = recorded.rstrip("/"), configured.rstrip("/")
    tracking = sqlite_path(tracking_uri)
    new_dir, old_dir = local_dir(configured), local_dir(recorded)
    if recorded == configured or tracking is None or new_dir is None or old_dir is None:
        return 0
    if not new_dir.is_dir():
        log.warning("MLflow experiment artifacts stay at %s: the configured %s does not hold "
                    "them", recorded, configured)
        return 0
    stores = {tracking: TRACKING_COLUMNS}
    registry = sqlite_path(registry_uri or tracking_uri)
    if registry is not None:
        stores[registry] = stores.get(registry, ()) + REGISTRY_COLUMNS
    rewritten = sum(_rewrite(db, columns, recorded, configured)
                    for db, columns in stores.items())
    log.info("MLflow store moved: %d artifact locations rewritten from %s to %s", rewritten,
             recorded, configured)
    return rewritten


def _rewrite(db: Path, columns: tuple[tuple[str, str], ...], old: str, new: str) -> int:
    connection = sqlite3.connect(db, timeout=60)
    try:
        with connection:  # one transaction: every location moves, or none
            connection.execute("BEGIN IMMEDIATE")
            tables = {r[0] for r in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            count = 0
            for table, column in columns:
                if table not in tables:
                    continue
                count += connection.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608
                    f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                    (new, len(old) + 1, old, len(old) + 1, old + "/")).rowcount
            return count
    finally:
        connection.close()
