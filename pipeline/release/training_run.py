"""The MLflow run of one drafter's training, open exactly as long as the training.

:class:`MlflowTrainingRun` is the :class:`~pipeline.training.curve.TrainingObserver` that
``drafter_checkpoint`` hands to the training stage: the run opens when training starts
(params, source, user, the Dagster run), takes each logged step's metrics while the run
trains, and closes when the drafter is committed, holding every step of the curve, the
curve chart and the drafter directory. A training that failed leaves its run FAILED; the
retry, which resumes the training, reopens it. ``registered_drafter`` later adds the
evaluation to the same run and registers the version from it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.records import to_dict
from pipeline.release.mlflow_runs import TrainingRuns

if TYPE_CHECKING:
    from pipeline.training.spec import TrainSpec


class MlflowTrainingRun:
    """Follows one training (see the module docstring). ``chart(curve)`` draws the curve
    as PNG bytes; ``tags`` go on the run (source, user, Dagster run and its link)."""

    def __init__(self, runs: TrainingRuns, *, run_name: str, tags: Mapping[str, Any],
                 chart: Callable[[Sequence[Mapping[str, Any]]], bytes] | None = None):
        self.runs = runs
        self.run_name = run_name
        self.tags = dict(tags)
        self.chart = chart
        self.run_id: str | None = None
        self.charts: list[str] = []  # artifact paths of the charts logged to the run
        self._logged: set[int] = set()

    def started(self, spec: TrainSpec) -> None:
        fingerprint = spec.fingerprint()
        if self.runs.find_run(fingerprint) is not None:
            return  # an earlier process finished it (its drafter is about to be committed)
        self.run_id = self.runs.find_unfinished_run(fingerprint)
        if self.run_id is None:
            self.run_id = self.runs.start_run(fingerprint, params=to_dict(spec.config),
                                              tags=self.tags, run_name=self.run_name)
        else:  # a resumed training goes on in its run
            self.runs.reopen(self.run_id)
            self.runs.set_tags(self.run_id, self.tags)
            self._logged = self.runs.logged_steps(self.run_id)

    def logged(self, entry: dict[str, Any]) -> None:
        if self.run_id is not None and int(entry["step"]) not in self._logged:
            self.runs.log_history(self.run_id, [entry])
            self._logged.add(int(entry["step"]))

    def failed(self) -> None:
        if self.run_id is not None:
            self.runs.finish_run(self.run_id, failed=True)

    def committed(self, spec: TrainSpec, curve: Sequence[Mapping[str, Any]],
                  drafter_dir: Callable[[], Path]) -> None:
        fingerprint = spec.fingerprint()
        done = self.runs.find_run(fingerprint)
        if done is not None:
            self.run_id, self.charts = done, self.runs.charts(done)
            return
        if self.run_id is None:  # committed by a process whose run was lost
            self.run_id = self.runs.find_unfinished_run(fingerprint) or self.runs.start_run(
                fingerprint, params=to_dict(spec.config), tags=self.tags,
                run_name=self.run_name)
            self._logged = self.runs.logged_steps(self.run_id)
        try:
            self.runs.log_history(self.run_id, [e for e in curve
                                                if int(e["step"]) not in self._logged])
            if self.chart is not None:
                with tempfile.TemporaryDirectory(prefix="aerie-curve-") as tmp:
                    png = Path(tmp) / "training_curve.png"
                    png.write_bytes(self.chart(curve))
                    self.charts += self.runs.log_charts(self.run_id, [png])
            self.runs.log_drafter(self.run_id, drafter_dir())
        except BaseException:
            self.runs.finish_run(self.run_id, failed=True)
            raise
        self.runs.finish_run(self.run_id)
