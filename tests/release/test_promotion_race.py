"""Promotion across hosts: the PostgreSQL lease (:mod:`pipeline.release.lease`) against a
real PostgreSQL server, with MLflow's tracking and registry on the same server.

The race: 8 promoter processes, each with a candidate it evaluated while no drafter was
served, all released at once. Exactly one may win; the alias and the serving manifest must
agree on it; no serving update may be lost. The same race with the planted bug of the old
design (a lock file per host, so nothing excludes the hosts from each other) must break
those invariants, or the race would prove nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg2
import pytest

from pipeline.release.backend import LedgerBackend
from pipeline.release.gate import Candidate, decide
from pipeline.release.lease import LeaseLost, PostgresLease, fenced
from pipeline.release.ledger import ServingLedger, StaleFencingToken, fencing_token
from pipeline.release.lock import LockTimeout
from pipeline.release.mlflow_registry import CHAMPION, DrafterRegistry
from pipeline.release.promotion import promote, serving_target
from pipeline.storage import Storage
from pipeline.verified import IntegrityError
from tests import forking
from tests.release import promoter
from tests.release.helpers import (
    POLICY,
    SETTINGS,
    create_mlflow_tables,
    lineage,
    make_drafter_dir,
    publish_drafter,
    summary,
)

pytestmark = pytest.mark.integration

PROMOTERS = 8
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    return make_drafter_dir(tmp_path_factory.mktemp("drafter") / "d")


@pytest.fixture(scope="module")
def mlflow_database(postgres, tmp_path_factory) -> str:
    """A database with MLflow's tables, created once and copied for each test's world. They
    are created in a child process, so that no connection to the copied database stays
    open."""
    url = postgres.new_database("mlflow_tables")
    log = tmp_path_factory.mktemp("mlflow-tables") / "create.log"
    assert forking.finish(forking.start(create_mlflow_tables, url, log=log),
                          timeout_s=120) == 0, log.read_text()[-3000:]
    return url


@pytest.fixture
def world(postgres, mlflow_database, tmp_path, drafter_dir):
    """A Postgres-backed registry with PROMOTERS candidate versions, a storage and a lease
    database (the same server, as a deployment would use)."""
    url = postgres.new_database("mlflow", template=mlflow_database)
    family = f"race{uuid.uuid4().hex[:8]}"
    artifacts = (tmp_path / "artifacts").as_uri()
    registry = DrafterRegistry.connect(url, family, artifact_location=artifacts,
                                       lock_url=url, lock_timeout_s=30)
    storage = Storage((tmp_path / "storage").as_uri())
    versions = []
    for i in range(PROMOTERS):
        fingerprint = uuid.uuid4().hex
        uri = publish_drafter(storage, 10 + i, drafter_dir, fingerprint)
        versions.append(registry.publish(drafter_dir=drafter_dir, lineage=lineage(
            fingerprint, uri, step=10 + i)).version.version)
    return {"url": url, "family": family, "artifacts": artifacts, "registry": registry,
            "storage": storage, "versions": versions,
            "serving": LedgerBackend(ServingLedger(storage, registry.model_name), SETTINGS)}


def race(world, tmp_path, *, per_host_files: bool) -> list[dict]:
    """Run the promoters at once, each a process of its own (forked from a warm parent,
    :mod:`tests.forking`: a started python spent ~7 s of CPU importing torch and MLflow,
    eight of them most of the race); their outcomes."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = []
    for i, version in enumerate(world["versions"]):
        job = {"tracking": world["url"], "family": world["family"],
               "artifacts": world["artifacts"], "storage": world["storage"].url(""),
               "version": version, "barrier": str(barrier), "n": PROMOTERS,
               "hold": per_host_files, "out": str(tmp_path / f"out-{i}.json")}
        if per_host_files:  # the planted bug: each "host" locks its own file
            job["lock_path"] = str(tmp_path / f"host-{i}" / "promotion.lock")
        else:
            job["lock_url"] = world["url"]
        procs.append(forking.start(promoter.main, job, log=tmp_path / f"promoter-{i}.log"))
    for i, proc in enumerate(procs):
        assert forking.finish(proc, timeout_s=300) == 0, \
            (tmp_path / f"promoter-{i}.log").read_text()[-3000:]
    return [json.loads((tmp_path / f"out-{i}.json").read_text()) for i in range(PROMOTERS)]


def violations(world, outcomes: list[dict]) -> list[str]:
    """What breaks "exactly one winner, alias and serving agree, no lost update"."""
    found = []
    winners = [o["version"] for o in outcomes if o["action"] == "promoted"]
    if len(winners) != 1:
        found.append(f"{len(winners)} promoters reported promoted: {winners}")
    applied = sum(o["applied"] for o in outcomes)
    if applied != 1:
        found.append(f"{applied} serving updates were applied")
    try:
        current = world["serving"].current()
        manifests = world["serving"].ledger.history()
    except IntegrityError as e:  # writers overwrote each other's records
        return [*found, f"the serving record is corrupt: {e}"]
    served = current.target.registry_version if current and current.target else None
    alias = world["registry"].alias(CHAMPION)
    if alias != served:
        found.append(f"alias {CHAMPION} is {alias} but serving serves {served}")
    if winners and served not in winners:
        found.append(f"serving serves {served}, not the winner {winners}")
    if len(manifests) != applied:
        found.append(f"{applied} serving updates applied, {len(manifests)} recorded (lost)")
    standing = [v for v in world["versions"]
                if world["registry"].get_version(v).tags.get("gate.decision") == "promoted"]
    if len(standing) != 1:
        found.append(f"{len(standing)} versions stand as promoted: {standing}")
    return found


@pytest.mark.integration
def test_eight_promoters_on_postgres_have_exactly_one_winner(world, tmp_path):
    outcomes = race(world, tmp_path, per_host_files=False)
    print("lease:", sorted(o["action"] for o in outcomes))
    assert violations(world, outcomes) == []
    assert sorted(o["action"] for o in outcomes) == ["promoted"] + ["refused"] * 7
    winner = next(o["version"] for o in outcomes if o["action"] == "promoted")
    for loser in (o for o in outcomes if o["action"] == "refused"):
        assert f"v{winner} became champion since" in loser["reasons"][0]
    manifest = world["serving"].current()
    token = fencing_token(manifest)
    assert token is not None
    assert world["registry"].get_version(winner).tags["promotion_token"] == str(token)


@pytest.mark.integration
def test_the_race_catches_per_host_locks(world, tmp_path):
    """The planted bug (a lock file per host): the same race finds the violations."""
    outcomes = race(world, tmp_path, per_host_files=True)
    found = violations(world, outcomes)
    print("per-host files:", sorted(o["action"] for o in outcomes), found)
    assert any("serving updates were applied" in v for v in found), found
    assert len(found) >= 2, found  # and the records show it: lost or corrupt updates


def _terminate_lease_sessions(url: str) -> int:
    """End every lease session on the server (a holder partitioned from the database)."""
    conn = psycopg2.connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'aerie-promotion-lease'")
        ended = cur.rowcount
    conn.close()
    return ended


def test_a_stale_holder_is_fenced_out(world):
    """A holder whose session ended writes nothing more, even after the next holder
    finished; a write it had in flight is refused by the ledger's token."""
    registry, serving, (v1, v2) = world["registry"], world["serving"], world["versions"][:2]
    stale = PostgresLease(world["url"], registry.model_name, timeout_s=5)
    stale.acquire()
    assert _terminate_lease_sessions(world["url"]) == 1
    decision = decide(Candidate(summary(2.0), format_ok=True), None, None, POLICY)
    assert promote(registry, serving, v2, decision).action == "promoted"
    newer = fencing_token(serving.current())
    assert newer > stale.token

    stale_registry = registry.fenced_by(stale)
    with pytest.raises(LeaseLost, match="session ended"):
        stale_registry.set_alias(CHAMPION, v1)
    stale_serving = fenced(serving, stale, ("apply",), token=stale.token)
    target = serving_target(registry.get_version(v1))
    with pytest.raises(LeaseLost):
        stale_serving.apply(target, reason="stale")
    with pytest.raises(StaleFencingToken, match=f"token {newer}"):  # a write in flight
        serving.apply(target, reason="stale", token=stale.token)
    assert registry.alias(CHAMPION) == v2 and serving.current().target.registry_version == v2
    assert len(serving.ledger.history()) == 1
    stale.release()


def test_the_lease_excludes_waits_and_names_its_holder(world):
    name = world["registry"].model_name
    with PostgresLease(world["url"], name, holder="host-a pid 1") as first:
        with pytest.raises(LockTimeout, match="held by host-a pid 1"):
            PostgresLease(world["url"], name, timeout_s=0.3).acquire()
        with first.fenced():
            pass
    with PostgresLease(world["url"], name, timeout_s=1) as second:
        assert second.token > first.token


def test_a_dead_holder_releases_the_lease_at_once(world):
    name = world["registry"].model_name
    code = ("import sys, time; from pipeline.release.lease import PostgresLease; "
            f"lease = PostgresLease({world['url']!r}, {name!r}); lease.acquire(); "
            "print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(LockTimeout):
            PostgresLease(world["url"], name, timeout_s=0.3).acquire()
    finally:
        proc.kill()
        proc.wait()
    with PostgresLease(world["url"], name, timeout_s=10) as lease:
        assert lease.held


def test_urls_are_shown_without_their_password():
    from pipeline.release.lease import redacted

    assert redacted("postgresql://aerie:s3cret@db:5432/m") == "postgresql://aerie:***@db:5432/m"
    assert redacted("postgresql://db/m?sslmode=require&password=s3cret") == \
        "postgresql://db/m?sslmode=require&password=***"
    assert redacted("host=db password=s3cret") == "<connection string>"
    assert redacted("postgresql://aerie@db/m") == "postgresql://aerie@db/m"
    lease = PostgresLease("postgresql://aerie:s3cret@db/m", "x")
    assert "s3cret" not in repr(lease)
