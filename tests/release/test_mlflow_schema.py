"""The pin on :mod:`pipeline.release.mlflow_relocate`, the one module that writes MLflow's
own tables (MLflow has no API to change a recorded artifact location).

A fresh embedded store made by the installed MLflow (tracking and registry in one sqlite
database, as Aerie's default) must have every table and column the rewrite touches. An
MLflow upgrade that renames one fails here, not by a moved store silently keeping its old
locations (the rewrite skips a table it does not find, for stores older than the table).
"""

from __future__ import annotations

import sqlite3

import pytest

from pipeline.release.mlflow_relocate import REGISTRY_COLUMNS, TRACKING_COLUMNS

pytestmark = pytest.mark.integration  # mlflow's import alone costs seconds (and `uname -p`)


def schema(db) -> dict[str, set[str]]:
    """``{table: columns}`` of a sqlite database."""
    with sqlite3.connect(db) as c:
        tables = [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = "
                                          "'table'")]
        return {t: {r[1] for r in c.execute(f"PRAGMA table_info({t})")} for t in tables}


def test_the_relocated_columns_are_in_mlflows_schema(tmp_path):
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
    client.search_experiments()  # creates the tracking schema
    client.search_registered_models()  # and the registry's
    tables = schema(db)
    assert {"experiments", "runs", "model_versions"} <= tables.keys()  # the schema was made
    missing = [f"{table}.{column}" for table, column in TRACKING_COLUMNS + REGISTRY_COLUMNS
               if column not in tables.get(table, ())]
    assert missing == []
