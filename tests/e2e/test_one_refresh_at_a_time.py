"""The embedded default's instance runs one refresh at a time, as Dagster's own daemon
launches them: two ``drafter_refresh`` runs submitted together through the run queue
(``dagster job launch``) are dequeued and run by ``dagster-daemon`` one after the other.

The runs refresh steps that were never ingested, so each fails fast in its own process; what
is checked is when each ran. Without the instance's ``aerie/serial`` limit the daemon
dequeues both in one iteration and their processes start together (each takes seconds to
load the code location), so their run intervals would overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus

from aerie import cli
from assets.partitions import ensure_partition, refresh_steps
from tests.conftest import ServerProcess
from tests.e2e.loop import FOREIGN_ENV

pytestmark = pytest.mark.e2e

STEPS = ("step-000001", "step-000003")
DONE = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def test_the_daemon_runs_one_refresh_at_a_time(tmp_path, monkeypatch):
    for var in FOREIGN_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster"))
    home = cli.prepare_dagster_home()  # the instance's limits and the workspace
    workspace = home / "workspace.yaml"
    with DagsterInstance.get() as instance:
        for step in STEPS:
            ensure_partition(instance, refresh_steps, step)
    for step in STEPS:  # queued by the instance's run coordinator, as the UI's Launch does
        subprocess.run([_bin("dagster"), "job", "launch", "-w", str(workspace), "-j",
                        "drafter_refresh", "--tags", json.dumps({"dagster/partition": step})],
                       check=True, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    with DagsterInstance.get() as instance:
        queued = instance.get_run_records()
        assert [r.dagster_run.status for r in queued] == [DagsterRunStatus.QUEUED] * 2

        daemon = ServerProcess([_bin("dagster-daemon"), "run", "-w", str(workspace)],
                               tmp_path / "daemon.log", group=True, env=dict(os.environ))
        try:
            deadline = time.monotonic() + 240
            while True:
                records = instance.get_run_records()
                if all(r.dagster_run.status in DONE for r in records):
                    break
                assert time.monotonic() < deadline, [r.dagster_run.status for r in records]
                assert daemon.proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
                time.sleep(0.5)
        finally:
            daemon.stop(grace_s=10)
    assert {r.dagster_run.tags["dagster/partition"] for r in records} == set(STEPS)
    assert all(r.start_time and r.end_time for r in records), "a run never started"
    first, second = sorted(records, key=lambda r: r.start_time)
    assert first.end_time <= second.start_time, (first.end_time, second.start_time)
