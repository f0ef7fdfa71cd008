"""A finished state moves and goes on working there.

The loop's home (tests/e2e/loop.py) is copied, then renamed: once to a new directory on the
same disk, once with its storage uploaded to S3 (moto_server) instead. While the moved state
runs, the original home is renamed away, so anything that still reads or writes the old
place fails or recreates it (both caught). In the moved state, one process (as a user would
start it) goes on where the loop stopped: the RL trainer writes step 6, the snapshot sensor
ingests it, a tick of the refresh schedule trains, evaluates and gates the step-6 drafter
against the champion, and ``aerie promote`` (the manual override) makes version 2
(registered before the move) champion; the serving record it writes must resolve in the new
place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.evaluation.stage import read_report
from pipeline.serving_now import read_serving, resolve_serving
from pipeline.storage import Storage
from tests.conftest import s3_options
from tests.e2e.loop import FOREIGN_ENV, PENDING, TRAIN

pytestmark = pytest.mark.e2e

CHECKOUT = Path(__file__).resolve().parents[2]
# What runs in the moved state (see the module docstring); prints what it saw as JSON.
SCRIPT = """
import json, sys
from dagster import DagsterInstance
from aerie import cli
from aerie.demo import RefreshLoop
from pipeline.serving_now import read_serving
from pipeline.snapshot.writer import SnapshotWriter
from resources.home import aerie_home
from resources.storage import storage_from_environment

storage = storage_from_environment()
step = json.loads((aerie_home() / sys.argv[2]).read_text())
SnapshotWriter(storage).write_step(
    step["step"], step["records"], aerie_home() / step["policy_dir"], step["policy_version"])
loop = RefreshLoop(DagsterInstance.get(), refresh_config=lambda n: json.loads(sys.argv[1]))
ingested = loop.ingest()
refreshed = loop.refresh_newest()
assert cli.main(["promote", "2", "--actor", "mover", "--reason", "after the move"]) == 0
serving = read_serving(storage, "aerie-drafter-demo")
print(json.dumps({"ingested": ingested, "refreshed": refreshed,
                  "champion": serving.target.registry_version}))
"""

@dataclass
class Moved:
    home: Path
    storage: Storage
    outcome: dict
    old_places: list[Path]  # where the state was: none of them may exist afterwards
    leftovers: list[Path]


@contextlib.contextmanager
def renamed_away(path: Path) -> Iterator[None]:
    """``path`` does not exist inside the block; it is put back afterwards."""
    away = path.with_name(path.name + ".away")
    path.rename(away)
    try:
        yield
    finally:
        if path.exists():  # recreated by the moved state: keep it for the assertion
            path.rename(path.with_name(path.name + ".recreated"))
        away.rename(path)


def _run_there(home: Path, original: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    clean.update(AERIE_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), **env)
    with renamed_away(original):
        done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TRAIN), PENDING],
                              cwd=CHECKOUT,
                              env=clean, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mentions(root: Path, needle: str, skip: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` (outside ``skip``) whose bytes contain ``needle``."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.relative_to(root).parts[0] not in skip \
                and needle.encode() in path.read_bytes():
            found.append(path)
    return found


# History, not references: Dagster's event log keeps each materialization's metadata as shown
# when it happened (links into the storage of that time), and training/ keeps each run's
# scratch (its spec.json and train.log name the paths of the process that ran; a resume
# writes its own spec). Nothing reads either back to find data: the old home is gone while
# the moved state runs.
HISTORY = ("dagster", "training")


@pytest.fixture(scope="module")
def moved_home(finished_loop, tmp_path_factory) -> Moved:
    base = tmp_path_factory.mktemp("moved")
    shutil.copytree(finished_loop.home, base / "copied", symlinks=True)
    home = (base / "copied").rename(base / "home")
    outcome = _run_there(home, finished_loop.home)
    old = [finished_loop.home.with_name(finished_loop.home.name + ".recreated"), base / "copied"]
    return Moved(home, Storage((home / "storage").as_uri()), outcome, old,
                 _mentions(home, str(finished_loop.home), HISTORY))


@pytest.fixture(scope="module")
def moved_to_s3(finished_loop, tmp_path_factory, moto_endpoint) -> Moved:
    base = tmp_path_factory.mktemp("to-s3")
    home = base / "home"
    shutil.copytree(finished_loop.home, home, symlinks=True,
                    ignore=lambda d, names: ["storage"] if Path(d) == finished_loop.home else [])
    bucket = f"aerie-{uuid.uuid4().hex[:12]}"
    storage = Storage(f"s3://{bucket}/aerie", s3_options(moto_endpoint))
    storage.fs.mkdir(bucket)
    storage.fs.put(str(finished_loop.home / "storage") + "/", storage.path(""), recursive=True)
    options = s3_options(moto_endpoint)
    outcome = _run_there(home, finished_loop.home, AERIE_STORAGE_URL=storage.root_url,
                         AWS_ENDPOINT_URL=moto_endpoint, AWS_ACCESS_KEY_ID=options["key"],
                         AWS_SECRET_ACCESS_KEY=options["secret"])
    old = [finished_loop.home.with_name(finished_loop.home.name + ".recreated")]
    return Moved(home, storage, outcome, old,
                 _mentions(home, str(finished_loop.home), HISTORY))


@pytest.fixture(params=["moved_home", "moved_to_s3"])
def moved(request, finished_loop) -> Moved:
    """Each way of moving the finished loop (``finished_loop`` named here so that an xdist
    run keeps these tests on the worker that built it, tests/tiers.py)."""
    return request.getfixturevalue(request.param)


def test_a_refresh_runs_in_the_moved_state(moved):
    assert moved.outcome["ingested"] == ["step-000006"]
    assert moved.outcome["refreshed"] == ["step-000006"]
    report = read_report(moved.storage, 6)  # evaluated against the champion served before
    assert {"candidate", "champion", "no_drafter"} <= set(report.contestants)
    assert all(c.outputs_match_baseline == report.heldout["prompts"]
               for c in report.contestants.values())


def test_a_version_registered_before_the_move_is_served_from_the_new_place(moved, tmp_path):
    assert moved.outcome["champion"] == "2"
    serving = read_serving(moved.storage, "aerie-drafter-demo")
    assert serving.target is not None and serving.target.registry_version == "2"
    launch = resolve_serving(moved.storage, "aerie-drafter-demo", tmp_path / "cache")
    assert (launch.drafter_dir / "config.json").is_file()


def test_nothing_reads_writes_or_records_the_old_place(moved):
    assert [p for p in moved.old_places if p.exists()] == []
    assert moved.leftovers == []
