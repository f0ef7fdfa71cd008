"""Charts in Dagster's metadata, one click away.

Each chart is stored beside its step's data (``evals/…/charts/``, for the CLI and the docs)
and logged to the MLflow run of the drafter it is about; the metadata links the MLflow copy
through the MLflow UI (``aerie ui`` starts it on the embedded store): the link opens the
run's page with the PNG previewed, and still does after the state moves (it names a run,
not a path). Where no MLflow run holds the chart (tracking failed, no drafter yet), the
entry is the stored copy's URL, and the log says why.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dagster import MetadataValue

from resources.mlflow import MlflowResource


def logged_chart(mlflow: MlflowResource, locate: Callable[[], tuple[Any, str | None]],
                 name: str, png: bytes, stored_url: str, log: Any) -> MetadataValue:
    """Log ``png`` as ``charts/<name>.png`` of the run ``locate()`` finds (``(runs, run_id)``)
    and link it (see the module). ``log``: the step's logger; a run that holds no chart
    (no drafter serves yet) is said at INFO, a failure to log one as a warning."""
    warn = log.warning
    try:
        runs, run_id = locate()
        if run_id is None:  # expected before the first promotion: nothing went wrong
            log.info(f"chart {name}: no MLflow run holds it yet; linking the stored copy")
            return MetadataValue.path(stored_url)
        with tempfile.TemporaryDirectory(prefix="aerie-chart-") as tmp:
            path = Path(tmp) / f"{name}.png"
            path.write_bytes(png)
            (artifact,) = runs.log_charts(run_id, [path])
    except Exception as e:  # noqa: BLE001 - a chart never fails the step; said, not hidden
        warn(f"chart {name}: not logged to MLflow ({type(e).__name__}: {e}); linking the "
             "stored copy")
        return MetadataValue.path(stored_url)
    return MetadataValue.url(mlflow.artifact_link(runs.experiment_id(), run_id, artifact))


def run_chart(mlflow: MlflowResource, runs, run_id: str | None, logged: list[str], name: str,
              stored_url: str) -> MetadataValue:
    """The link to chart ``name`` that ``run_id`` holds already (``logged``: its chart
    artifacts), else the stored copy's URL."""
    artifact = f"charts/{name}.png"
    if run_id is not None and artifact in logged:
        return MetadataValue.url(mlflow.artifact_link(runs.experiment_id(), run_id, artifact))
    return MetadataValue.path(stored_url)
