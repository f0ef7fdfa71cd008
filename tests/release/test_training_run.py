"""The MLflow run of one training (``MlflowTrainingRun``) against an embedded MLflow: open
while the run trains, each logged step as it arrives, FAILED when training fails, reopened
by the retry that resumes it, closed with every step once; and the training stage's calls to
it are best effort."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import pytest

from pipeline.release.training_run import MlflowTrainingRun
from pipeline.training.config import TrainConfig
from pipeline.training.stage import _Follow
from tests.release.helpers import make_drafter_dir

pytestmark = pytest.mark.integration


@dataclass
class Spec:
    fp: str = field(default_factory=lambda: uuid.uuid4().hex)
    config: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-3, epochs=3))

    def fingerprint(self) -> str:
        return self.fp


def entry(step: int) -> dict:
    return {"step": step, "lr": 1e-3, "loss": 10.0 / step, "accuracy": [0.5, 0.4],
            "sim_accept_length": 1.2}


def observer(registry) -> MlflowTrainingRun:
    return MlflowTrainingRun(registry.runs, run_name="drafter-step-000003",
                             tags={"dagster.run_id": "run-1"}, chart=lambda curve: PNG)


PNG = (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)


def steps(registry, run_id: str) -> list[int]:
    return sorted(m.step for m in registry.client.get_metric_history(run_id, "train/loss"))


def test_a_failed_training_is_resumed_in_its_run_and_closed_with_every_step_once(
        sqlite_registry, tmp_path):
    registry, spec = sqlite_registry, Spec()
    first = observer(registry)
    first.started(spec)
    run_id = first.run_id
    info = registry.client.get_run(run_id)
    assert info.info.status == "RUNNING" and info.data.params["lr"] == "0.001"
    first.logged(entry(1))
    first.logged(entry(2))
    assert steps(registry, run_id) == [1, 2]  # live, before the training ends
    first.failed()
    assert registry.client.get_run(run_id).info.status == "FAILED"

    retry = observer(registry)  # the re-run resumes the training
    retry.started(spec)
    assert retry.run_id == run_id
    assert registry.client.get_run(run_id).info.status == "RUNNING"
    retry.logged(entry(3))
    retry.committed(spec, [entry(s) for s in range(1, 5)],
                    lambda: make_drafter_dir(tmp_path / "drafter"))
    done = registry.client.get_run(run_id)
    assert done.info.status == "FINISHED"
    assert steps(registry, run_id) == [1, 2, 3, 4]  # every step, none twice
    assert [a.path for a in registry.client.list_artifacts(run_id, "charts")] == [
        "charts/training_curve.png"]
    assert registry.runs.find_run(spec.fingerprint()) == run_id  # registration finds it

    again = observer(registry)  # a later refresh of the same drafter: nothing reopened
    again.started(spec)
    assert again.run_id is None
    again.committed(spec, [], lambda: pytest.fail("no copy needed"))
    assert again.run_id == run_id and steps(registry, run_id) == [1, 2, 3, 4]


def test_a_running_run_of_another_process_is_not_taken_over(sqlite_registry):
    registry, spec = sqlite_registry, Spec()
    busy = observer(registry)
    busy.started(spec)
    other = observer(registry)
    other.started(spec)
    assert other.run_id != busy.run_id


class Broken:
    calls = 0

    def logged(self, entry):
        Broken.calls += 1
        raise ConnectionError("tracking server gone")


def test_tracking_failures_never_stop_the_training(caplog):
    follow = _Follow(Broken())
    with caplog.at_level(logging.WARNING):
        follow("logged", entry(1))
        follow("logged", entry(2))  # not called again once it failed
    assert Broken.calls == 1
    assert "training tracking failed in logged (ConnectionError" in caplog.text
