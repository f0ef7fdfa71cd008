"""Hostile records through the whole of stage 1: SnapshotWriter.write_step, stage.run,
read_accepted. Every record is accepted or quarantined (never a crash), the counts add up on
both sides, and every accepted record keeps the contract by an independent reading of it.
Bad step arguments and a records iterable that raises fail the step before it commits."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.layout import raw_prefix, snapshot_prefix
from pipeline.parquet import read_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.sieve import SnapshotError, StepArgumentError
from pipeline.snapshot.stage import read_accepted
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

from .snapshot_hostile import ACCEPT, MUTATIONS, hostile_batch
from .snapshot_reference import MAX_QUOTE, STEP, TALLY, contract_violations

pytestmark = pytest.mark.integration

CORPUS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])


def _check_step(storage: Storage, policy_dir, records: list, plan: list) -> list[str]:
    """Problems of one written and validated step; the tally is updated on the way."""
    problems = []
    wrote = SnapshotWriter(storage).write_step(STEP, records, policy_dir, STEP)
    read = snapshot_stage.run(storage, STEP)
    accepted = read_accepted(storage, STEP).to_pylist()
    TALLY.accepted += len(accepted)
    TALLY.quarantined += read.quarantined
    for summary in (wrote, read):
        if not summary.records_in == len(records) == summary.accepted + summary.quarantined:
            problems.append(f"counts {summary}")
    if read.accepted != wrote.accepted:
        problems.append(f"the stage accepted {read.accepted}, the writer {wrote.accepted}")
    for rec in accepted:
        broken = contract_violations(rec)
        if broken:
            problems.append(TALLY.fail(f"accepted a record breaking {broken}: {rec!r:.300}",
                                       "silently_accepted"))
    expected = Counter(rid for rid, _, verdict in plan if verdict == ACCEPT)
    got = Counter(r["rollout_id"] for r in accepted)
    for rid in (got - expected).elements():
        problems.append(TALLY.fail(f"accepted {rid!r}, built to be refused: {plan}",
                                   "silently_accepted"))
    for rid in (expected - got).elements():
        problems.append(TALLY.fail(f"quarantined {rid!r}, built to be accepted: {plan}",
                                   "wrongly_quarantined"))
    quarantine = read_table(storage, f"{snapshot_prefix(STEP)}/quarantine.parquet").to_pylist()
    for row in quarantine:
        if not row["field"] or not row["reason"] or any(
                len(row[c] or "") > MAX_QUOTE for c in ("field", "reason", "rollout_id")):
            problems.append(f"quarantine row unbounded or unnamed: {row!r:.300}")
        json.loads(row["record_json"])
    for prefix in (raw_prefix(STEP), snapshot_prefix(STEP)):
        if len(storage.read_bytes(f"{prefix}/_manifest.json")) > 64 * 1024:
            problems.append(f"{prefix}: manifest over 64 KiB")
    return problems


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@CORPUS
@given(data=st.data())
def test_hostile_records_are_accepted_or_quarantined(tmp_path_factory, policy_dir, mutation,
                                                    data):
    records, plan = data.draw(hostile_batch(mutation))
    TALLY.cases += 1
    TALLY.classes.update(f"record: {name}" for _, name, _ in plan)
    storage = Storage(str(tmp_path_factory.mktemp("records") / "store"))
    try:
        problems = _check_step(storage, policy_dir, records, plan)
    except Exception as e:  # a record must never fail the step, not even with a named error
        problems = [TALLY.fail(f"crash on {plan}: {type(e).__name__}: {e!s:.500}", "crashes")]
    assert not problems, problems


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(policy_version=st.one_of(
    st.integers(max_value=-1), st.integers(min_value=STEP + 1),
    st.sampled_from([True, False, 10**400, 2**63, "3", 3.0, None, np.float32(1), np.bool_(1),
                     [3]])))
def test_bad_policy_versions_fail_the_step_before_writing(tmp_path_factory, policy_dir,
                                                         policy_version):
    TALLY.cases += 1
    TALLY.classes["step: bad policy_version"] += 1
    storage = Storage(str(tmp_path_factory.mktemp("step") / "store"))
    try:
        SnapshotWriter(storage).write_step(STEP, [], policy_dir, policy_version)
    except StepArgumentError as e:
        TALLY.step_errors += 1
        assert "policy_version" in str(e) and storage.list() == []
        return
    except Exception as e:
        raise AssertionError(TALLY.fail(f"crash: {type(e).__name__}: {e}", "crashes")) from e
    raise AssertionError(TALLY.fail(f"policy_version {policy_version!r} accepted",
                                    "silently_accepted"))


def test_a_records_iterable_that_raises_leaves_the_step_uncommitted(tmp_path, policy_dir):
    def records():
        yield {"rollout_id": "x"}
        raise ConnectionError("rollout buffer lost")

    TALLY.cases += 1
    TALLY.classes["step: records iterable raises"] += 1
    storage = Storage(str(tmp_path / "store"))
    try:
        SnapshotWriter(storage).write_step(STEP, records(), policy_dir, STEP)
    except SnapshotError as e:
        TALLY.step_errors += 1
        assert "ConnectionError" in str(e)
        assert snapshot_stage.completed_steps(storage) == []
        return
    raise AssertionError(TALLY.fail("a raising iterable committed a step", "silently_accepted"))
