"""Training runs of one target family in MLflow tracking: params, metrics, charts, drafter.

:class:`TrainingRuns` owns the family's experiment and what a training run logs: params,
per-step training metrics (step index = training step), evaluation metrics, PNG charts under
``charts/`` and the exported drafter directory under ``drafter/`` (the source a registered
version points at).

Invariants:

- The experiment is created with an explicit artifact location when one is configured
  (a sqlite store would otherwise default to ``./mlruns`` in the working directory); a
  sqlite store moved with its artifacts follows them (:meth:`follow_moved_store`).
- A run is tagged with its drafter's ``fingerprint``; a run counts as reusable only when it
  FINISHED and its drafter upload completed (tag ``aerie.drafter_logged``).
- Metrics and params go in batches within MLflow's per-request limits; values are strings
  (params) or floats (metrics).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.release.lineage import FINGERPRINT, tag_value
from pipeline.release.mlflow_relocate import follow_moved_artifacts

if TYPE_CHECKING:
    from mlflow import MlflowClient

DRAFTER_ARTIFACT_PATH = "drafter"
CHARTS_ARTIFACT_PATH = "charts"
DRAFTER_LOGGED = "aerie.drafter_logged"
EVALUATION_LOGGED = "aerie.evaluation_logged"  # the eval fingerprint whose metrics it holds
# MLflow 3 opens an experiment in its GenAI view unless told it holds model training
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
_FINGERPRINT = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
_BATCH = 100  # MLflow allows 1000 metrics / 100 params per log_batch


class TrainingRuns:
    """The runs of one experiment (one target family)."""

    def __init__(self, client: MlflowClient, experiment_name: str, *,
                 artifact_location: str | None = None, family: str = ""):
        self.client = client
        self.experiment_name = experiment_name
        self.artifact_location = artifact_location
        self.family = family
        self._experiment_id: str | None = None

    # -- experiment --------------------------------------------------------------------
    def experiment_id(self) -> str:
        """The family's experiment, created on first use."""
        if self._experiment_id is None:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                try:
                    self._experiment_id = self.client.create_experiment(
                        self.experiment_name, artifact_location=self.location(),
                        tags={"aerie.family": self.family, EXPERIMENT_KIND[0]:
                              EXPERIMENT_KIND[1]})
                except Exception as e:  # a concurrent creator won
                    if error_code(e) != "RESOURCE_ALREADY_EXISTS":
                        raise
                    exp = self.client.get_experiment_by_name(self.experiment_name)
            if self._experiment_id is None:
                self._experiment_id = exp.experiment_id
                if exp.tags.get(EXPERIMENT_KIND[0]) is None:  # made by an older Aerie
                    self.client.set_experiment_tag(self._experiment_id, *EXPERIMENT_KIND)
        return self._experiment_id

    def location(self) -> str | None:
        """The experiment's artifact location under the configured root (None: the
        server's default)."""
        if not self.artifact_location:
            return None
        return f"{self.artifact_location.rstrip('/')}/{self.experiment_name}"

    def follow_moved_store(self, registry_uri: str | None = None) -> int:
        """After the store was copied or moved with its artifacts, point its recorded
        artifact locations at the configured place (:mod:`.mlflow_relocate`); returns the
        rows rewritten."""
        location = self.location()
        exp = self.client.get_experiment_by_name(self.experiment_name) if location else None
        if exp is None:
            return 0
        return follow_moved_artifacts(self.client.tracking_uri, registry_uri,
                                      exp.artifact_location, location)

    # -- runs -------------------------------------------------------------------------
    def find_run(self, fingerprint: str) -> str | None:
        """A FINISHED run of this family tagged with ``fingerprint`` that holds a drafter."""
        check_fingerprint(fingerprint)
        runs = self.client.search_runs(
            [self.experiment_id()],
            f"tags.{FINGERPRINT} = '{fingerprint}' and attributes.status = 'FINISHED'",
            max_results=10, order_by=["attributes.start_time DESC"])
        for run in runs:
            if run.data.tags.get(DRAFTER_LOGGED) == "true":
                return run.info.run_id
        return None

    def find_unfinished_run(self, fingerprint: str) -> str | None:
        """The newest run tagged with ``fingerprint`` that failed or was killed (a training
        to resume). A RUNNING one is left alone: another process may be training it."""
        check_fingerprint(fingerprint)
        runs = self.client.search_runs(
            [self.experiment_id()],
            f"tags.{FINGERPRINT} = '{fingerprint}' and attributes.status != 'FINISHED' "
            f"and attributes.status != 'RUNNING'",
            max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def reopen(self, run_id: str) -> None:
        self.client.update_run(run_id, status="RUNNING")

    def logged_steps(self, run_id: str, key: str = "train/loss") -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, key)}

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(str(k), tag_value(v)) for k, v in sorted(tags.items())]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(run_id, tags=items[i:i + _BATCH])

    def start_run(self, fingerprint: str, *, params: Mapping[str, Any] | None = None,
                  tags: Mapping[str, Any] | None = None, run_name: str | None = None) -> str:
        """A new training run tagged with ``fingerprint``; returns its id."""
        check_fingerprint(fingerprint)
        run_tags = {k: tag_value(v) for k, v in (tags or {}).items()}
        run_tags[FINGERPRINT] = fingerprint
        run = self.client.create_run(self.experiment_id(), tags=run_tags,
                                     run_name=run_name or f"drafter-{fingerprint[:12]}")
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), tag_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(run_id, params=items[i:i + _BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], *, step: int = 0,
                    prefix: str = "") -> int:
        """Log scalar metrics at ``step`` (e.g. evaluation τ and α); returns how many."""
        return self._log_metric_rows(run_id, [(step, f"{prefix}{k}", v)
                                              for k, v in metrics.items()])

    def log_history(self, run_id: str, history: Sequence[Mapping[str, Any]], *,
                    prefix: str = "train/") -> int:
        """Per-step training metrics: each entry has ``step``; numbers become metrics
        ``<prefix><key>``, lists of numbers ``<prefix><key>/<index>``. Returns how many."""
        rows = []
        for entry in history:
            step = int(entry["step"])
            for key, value in entry.items():
                if key == "step":
                    continue
                if isinstance(value, list | tuple):
                    rows += [(step, f"{prefix}{key}/{i}", v) for i, v in enumerate(value)
                             if _is_number(v)]
                elif _is_number(value):
                    rows.append((step, f"{prefix}{key}", value))
        return self._log_metric_rows(run_id, rows)

    def _log_metric_rows(self, run_id: str, rows: list[tuple[int, str, Any]]) -> int:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for step, key, value in rows]
        for i in range(0, len(metrics), _BATCH * 10):
            self.client.log_batch(run_id, metrics=metrics[i:i + _BATCH * 10])
        return len(metrics)

    def add_evaluation(self, run_id: str, tags: Mapping[str, Any],
                       metrics: Mapping[str, float], charts: Sequence[str | Path], *,
                       step: int) -> None:
        """Tag a training run with its drafter's lineage and log its evaluation (metrics at
        ``step``, charts), once per evaluation (tag ``aerie.evaluation_logged``)."""
        key = tag_value(tags.get("eval_fingerprint") or tags.get("tau", ""))
        if self.client.get_run(run_id).data.tags.get(EVALUATION_LOGGED) == key:
            return
        self.set_tags(run_id, tags)
        if metrics:
            self.log_metrics(run_id, metrics, step=step)
        self.log_charts(run_id, charts)
        self.client.set_tag(run_id, EVALUATION_LOGGED, key)

    def log_charts(self, run_id: str, paths: Sequence[str | Path]) -> list[str]:
        """Upload PNG charts under ``charts/``; returns their artifact paths."""
        logged = []
        for path in paths:
            path = Path(path)
            if path.suffix.lower() != ".png":
                raise ValueError(f"{path} is not a PNG chart")
            self.client.log_artifact(run_id, str(path), CHARTS_ARTIFACT_PATH)
            logged.append(f"{CHARTS_ARTIFACT_PATH}/{path.name}")
        return logged

    def charts(self, run_id: str) -> list[str]:
        """The artifact paths of the charts logged to ``run_id``."""
        return [a.path for a in self.client.list_artifacts(run_id, CHARTS_ARTIFACT_PATH)]

    def log_drafter(self, run_id: str, drafter_dir: str | Path) -> str:
        """Upload the exported drafter directory; returns its artifact URI (the source of a
        model version)."""
        drafter_dir = Path(drafter_dir)
        if not (drafter_dir / "config.json").is_file():
            raise ValueError(f"{drafter_dir} has no config.json: not a drafter directory")
        self.client.log_artifacts(run_id, str(drafter_dir), DRAFTER_ARTIFACT_PATH)
        self.client.set_tag(run_id, DRAFTER_LOGGED, "true")
        return self.drafter_source(run_id)

    def drafter_source(self, run_id: str) -> str:
        base = self.client.get_run(run_id).info.artifact_uri.rstrip("/")
        return f"{base}/{DRAFTER_ARTIFACT_PATH}"

    def finish_run(self, run_id: str, *, failed: bool = False) -> None:
        self.client.set_terminated(run_id, "FAILED" if failed else "FINISHED")


def check_fingerprint(fingerprint: str) -> None:
    """Fingerprints are interpolated into MLflow filter strings: no quotes or spaces."""
    if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
        raise ValueError(f"fingerprint {fingerprint!r} must match {_FINGERPRINT.pattern}")


def error_code(error: Exception) -> str | None:
    """The ``error_code`` of an ``MlflowException`` (None for other errors)."""
    return getattr(error, "error_code", None)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
