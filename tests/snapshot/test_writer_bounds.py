"""The writer's step-level errors and bounds: bad step arguments fail before anything is
written, a records iterable that raises leaves the step uncommitted, and what bad records
put in the manifest, the log and the metadata stays small however large they are."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layout import raw_prefix
from pipeline.parquet import read_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.render import QUOTE_CHARS
from pipeline.snapshot.sieve import MAX_REASONS, OTHER, SnapshotError, StepArgumentError
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

from .conftest import good_record, make_policy_dir

STEP = 3


@pytest.mark.parametrize("policy_version", [
    True, False, -1, STEP + 1, 2**63, 10**400, -(10**400), "3", 3.0, None, np.float64(3),
    np.bool_(True)], ids=lambda v: repr(v)[:20])
def test_a_bad_policy_version_fails_the_step_before_anything_is_written(tmp_path,
                                                                       policy_version):
    storage = Storage(str(tmp_path / "store"))
    with pytest.raises(StepArgumentError, match="policy_version") as err:
        SnapshotWriter(storage).write_step(STEP, [good_record(0)],
                                           make_policy_dir(tmp_path / "p"), policy_version)
    assert isinstance(err.value, ValueError) and len(str(err.value)) < 200
    assert storage.list() == []


@pytest.mark.parametrize("step", [True, -1, 2**63, "3", 3.5, None], ids=repr)
def test_a_bad_step_fails_before_anything_is_written(tmp_path, step):
    storage = Storage(str(tmp_path / "store"))
    with pytest.raises(StepArgumentError, match="step"):
        SnapshotWriter(storage).write_step(step, [], make_policy_dir(tmp_path / "p"), 0)
    assert storage.list() == []


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(version=st.integers(0, STEP), np_type=st.sampled_from([int, np.int64, np.uint8]))
def test_integral_policy_versions_up_to_the_step_are_recorded(tmp_path_factory, version,
                                                             np_type):
    tmp = tmp_path_factory.mktemp("ok")
    storage = Storage(str(tmp / "store"))
    SnapshotWriter(storage).write_step(STEP, [good_record(0)], make_policy_dir(tmp / "p"),
                                       np_type(version))
    meta = json.loads(storage.read_bytes(f"{raw_prefix(STEP)}/_manifest.json"))["meta"]
    assert meta["policy_version"] == version and type(meta["policy_version"]) is int


def test_a_records_iterable_that_raises_fails_the_step_uncommitted(tmp_path):
    storage = Storage(str(tmp_path / "store"))

    def records():
        yield good_record(0)
        yield good_record(1)
        raise OSError("trainer lost its rollout buffer")

    with pytest.raises(SnapshotError, match="records iterable raised OSError after row 1"):
        SnapshotWriter(storage).write_step(STEP, records(), make_policy_dir(tmp_path / "p"),
                                           STEP)
    assert not storage.exists(f"{raw_prefix(STEP)}/_manifest.json")


def test_huge_bad_records_keep_the_manifest_small(tmp_path, caplog):
    """4 records carrying 1.5 MB keys or values once made a 6 MB manifest and log line."""
    storage = Storage(str(tmp_path / "store"))
    big = "x" * 1_500_000
    records = [{**good_record(0), big: 1}, {**good_record(1), "junk": big},
               {**good_record(2), "token_fidelity": big}, {**good_record(3), "rollout_id": big}]
    with caplog.at_level(logging.WARNING):
        summary = SnapshotWriter(storage).write_step(STEP, records,
                                                     make_policy_dir(tmp_path / "p"), STEP)
    assert summary.quarantined == 4
    manifest = storage.read_bytes(f"{raw_prefix(STEP)}/_manifest.json")
    assert len(manifest) < 64 * 1024
    assert max(len(r.getMessage()) for r in caplog.records) < 4 * 1024
    quarantine = read_table(storage, f"{raw_prefix(STEP)}/quarantine.parquet").to_pylist()
    for row in quarantine:
        assert all(len(row[c]) <= QUOTE_CHARS + 20 for c in ("field", "reason", "rollout_id"))
        assert len(row["record_json"]) > 1_500_000  # the whole record is kept there
    validated = snapshot_stage.run(storage, STEP)
    assert validated.quarantined == 4
    assert len(storage.read_bytes(f"snapshots/step={STEP:06d}/_manifest.json")) < 64 * 1024


def test_reason_counts_are_capped_with_the_rest_summed(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    records = [{**good_record(i), f"unknown_{i}": 1} for i in range(50)]
    records += [{**good_record(100 + i), "reward": "high"} for i in range(3)]
    summary = SnapshotWriter(storage).write_step(STEP, records,
                                                 make_policy_dir(tmp_path / "p"), STEP)
    assert len(summary.reasons) == MAX_REASONS
    assert summary.reasons["reward: expected"] == 3  # the most common is kept by name
    assert summary.reasons[OTHER] == 53 - 3 - (MAX_REASONS - 2)
    assert sum(summary.reasons.values()) == summary.quarantined == 53
    assert snapshot_stage.run(storage, STEP).reasons == summary.reasons
