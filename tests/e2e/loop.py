"""The refresh loop the e2e tests read: the demo RL trainer writes one step at a time; the
snapshot sensor ingests it; the refresh sensor (N=2, K=2) asks for a refresh at steps 1, 3
and 5; each refresh trains, evaluates, registers and goes through the gate, on one
persistent Dagster instance under ``home``. Every gate outcome is fixed by the setup: cycle
1 has no champion, and a trained drafter beats no drafter; cycle 2 is held to a margin no
drafter can reach (τ <= num_steps + 1 = 4 while the champion's τ >= 1, so +1000% is
impossible) and is refused; cycle 3 is built to be worse (a from-scratch drafter trained for
one step) and is refused, the serving drafter left as it was. The trainer's step 6 is not
written: it waits in ``demo-world/pending-step.json`` (:func:`write_pending_step`), for a
test that moves the state first.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dagster import DagsterInstance

from aerie import cli
from aerie.demo import RefreshLoop
from bench.closed_loop import SMALL_TRAIN
from pipeline.demo.config import DemoConfig
from pipeline.storage import Storage
from resources.refresh import RefreshPolicyResource
from resources.run_config import deep_merge

POLICY = RefreshPolicyResource(every=2, window=2)
TRAIN = SMALL_TRAIN  # what a small world's refresh trains with
UNREACHABLE = {"ops": {"serving_drafter": {"config": {"min_relative_gain": 10.0}}}}
WORSE = {"ops": {"drafter_checkpoint": {"config": {
    "warm_start": "none", "max_steps": 1, "lr": 1e-6}}}}  # an untrained drafter
# by refresh step: cycles 1, 2 and 3 refresh at RL steps 1, 3 and 5
CYCLE_CONFIG = {1: TRAIN, 3: deep_merge(TRAIN, UNREACHABLE), 5: deep_merge(TRAIN, WORSE)}
REFRESHES = ["step-000001", "step-000003", "step-000005"]
PENDING = "demo-world/pending-step.json"
# the variables that would point Aerie somewhere other than the home under test
FOREIGN_ENV = ("AERIE_STORAGE_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
               "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI",
               "AERIE_CACHE_DIR")


@dataclass
class Loop:
    home: Path
    instance: DagsterInstance
    storage: Storage
    refreshed: list[str] = field(default_factory=list)
    sensor_ticks: list[str] = field(default_factory=list)  # "run" / "skip" per tick


@contextlib.contextmanager
def home_env(home: Path, **extra: str) -> Iterator[None]:
    """The environment of the embedded default kept in ``home`` (plus ``extra``)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in FOREIGN_ENV:
            mp.delenv(var, raising=False)
        mp.setenv("AERIE_HOME", str(home))
        mp.setenv("DAGSTER_HOME", str(home / "dagster"))
        for var, value in extra.items():
            mp.setenv(var, value)
        yield


def run_loop(home: Path) -> Loop:
    from pipeline.demo.world import generate_world
    from pipeline.snapshot.writer import SnapshotWriter

    cli.prepare_dagster_home()
    outputs = []  # the trainer's steps, published one at a time below
    generate_world(DemoConfig.small(num_steps=7), home / "demo-world", outputs.append,
                   progress=False)
    pending = outputs.pop()
    (home / PENDING).write_text(json.dumps({
        "step": pending.step, "policy_version": pending.policy_version,
        "policy_dir": str(pending.policy_dir.relative_to(home)), "records": pending.records}))
    storage = Storage((home / "storage").as_uri())
    writer = SnapshotWriter(storage)
    driver = RefreshLoop(DagsterInstance.get(), refresh_config=CYCLE_CONFIG.get, policy=POLICY)
    for out in outputs:
        writer.write_step(out.step, out.records, out.policy_dir, out.policy_version,
                          sampling=out.sampling)
        driver.after_step()  # snapshot sensor tick + ingest runs, refresh sensor tick + run
    return Loop(home, driver.instance, storage, driver.refreshed, driver.refresh_ticks)
