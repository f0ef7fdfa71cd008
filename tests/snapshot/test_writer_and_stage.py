"""Snapshot writer and validating reader: nothing lost, corruption named, counts add up."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.contracts import Manifest
from pipeline.layout import raw_prefix, snapshot_prefix
from pipeline.manifest import entry_for, read_manifest, write_manifest
from pipeline.parquet import ParquetFileError, read_table, write_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.sieve import QUARANTINE_SCHEMA, SnapshotError
from pipeline.snapshot.stage import completed_steps, read_accepted
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

from .conftest import good_record, make_policy_dir


def bad_records(step: int = 3) -> list[dict]:
    dup = good_record(0, step)
    return [
        {**good_record(100, step), "response_token_ids": [10**6]},  # outside the vocab
        {**good_record(101, step), "reward": "high"},  # wrong type
        {k: v for k, v in good_record(102, step).items() if k != "trainer_step"},  # missing
        {**good_record(103, step), "response_token_ids": []},  # empty response
        dup,  # duplicate id of record 0
    ]


def test_writer_and_reader_keep_every_record(storage, policy_dir):
    good = [good_record(i) for i in range(12)]
    summary = SnapshotWriter(storage, rows_per_file=5).write_step(
        3, good + bad_records(), policy_dir, policy_version=3)
    assert (summary.records_in, summary.accepted, summary.quarantined) == (17, 12, 5)
    assert summary.reasons == {
        "response_token_ids: outside the tokenizer's range": 1, "reward: expected": 1,
        "trainer_step: missing": 1, "response_token_ids: empty": 1,
        "rollout_id: duplicate of": 1}
    assert completed_steps(storage) == [3]

    validated = snapshot_stage.run(storage, 3)
    assert (validated.records_in, validated.accepted, validated.quarantined) == (17, 12, 5)
    table = read_accepted(storage, 3)
    assert table.column("rollout_id").to_pylist() == [r["rollout_id"] for r in good]
    # the published checkpoint, by its key under the storage root (the state can move)
    assert table.column("policy_uri")[0].as_py() == "policies/step=000003"
    assert validated.tokens == sum(len(r["prompt_token_ids"]) + len(r["response_token_ids"])
                                   for r in good)
    quarantine = read_table(storage, f"{snapshot_prefix(3)}/quarantine.parquet").to_pylist()
    assert [q["rollout_id"] for q in quarantine] == ["r3-100", "r3-101", "r3-102", "r3-103",
                                                     "r3-0"]
    assert '"reward": "high"' in quarantine[1]["record_json"]  # the raw record is kept
    manifest = read_manifest(storage, snapshot_prefix(3))
    assert manifest.meta["accepted"] == 12 and manifest.meta["policy_version"] == 3


def test_rewriting_a_step_gives_identical_bytes(tmp_path, policy_dir):
    storage = Storage(tmp_path.as_uri())
    records = [good_record(i) for i in range(6)]
    SnapshotWriter(storage).write_step(3, records, policy_dir, 3)
    first = {k: storage.read_bytes(k) for k in storage.list()}
    SnapshotWriter(storage).write_step(3, records, policy_dir, 3)
    assert {k: storage.read_bytes(k) for k in storage.list()} == first


def test_unfinished_step_is_not_listed_and_not_readable(tmp_path, policy_dir):
    storage = Storage(tmp_path.as_uri())
    SnapshotWriter(storage).write_step(1, [good_record(0, 1)], policy_dir, 1)
    storage.write_bytes(f"{raw_prefix(2)}/part-00000.parquet", b"half a step")
    assert completed_steps(storage) == [1]
    with pytest.raises(SnapshotError, match="no completion marker"):
        snapshot_stage.run(storage, 2)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_file_is_an_error_naming_it(tmp_path, policy_dir, damage):
    storage = Storage(tmp_path.as_uri())
    SnapshotWriter(storage).write_step(3, [good_record(i) for i in range(50)], policy_dir, 3)
    key = f"{raw_prefix(3)}/part-00000.parquet"
    data = bytearray(storage.read_bytes(key))
    if damage == "flip":
        data[len(data) // 3] ^= 0x10
    else:
        data = data[: len(data) // 2]
    storage.write_bytes(key, bytes(data))
    with pytest.raises(SnapshotError, match="part-00000.parquet"):
        snapshot_stage.run(storage, 3)  # caught by the manifest's sha256
    with pytest.raises(ParquetFileError, match="part-00000.parquet"):
        read_table(storage, key)  # and by Parquet itself (page CRC / footer)


def test_foreign_parquet_with_bad_values_is_quarantined_per_record(tmp_path):
    """A file written by another tool: loose types, invalid UTF-8, an unknown column."""
    storage = Storage(tmp_path.as_uri())
    policy = make_policy_dir(tmp_path / "policy")
    SnapshotWriter(storage).write_step(3, [good_record(0)], policy, 3)
    prefix = raw_prefix(3)
    uri = storage.url("policies/step=000003")
    foreign = pa.table({
        "rollout_id": pa.array([b"f-0", b"f-\xff", b"f-2"], pa.binary()),
        "trainer_step": [3, 3, 3], "generated_by_policy_version": [3, 3, 3],
        "policy_uri": [uri] * 3, "prompt": ["q", "q", "q"],
        "response_token_ids": [[1, 2], [1], [1]],
        "reward": ["0.1", None, None],  # strings where numbers belong
        "token_fidelity": ["retokenized"] * 3,
    })
    written = write_table(storage, f"{prefix}/part-00001.parquet", foreign)
    manifest = read_manifest(storage, prefix)
    files = (*manifest.files, entry_for(prefix, written, rows=3))
    meta = {**manifest.meta, "records_in": manifest.meta["records_in"] + 3}
    write_manifest(storage, prefix, Manifest(kind=manifest.kind,
                                             kind_version=manifest.kind_version,
                                             files=files, meta=meta))
    summary = snapshot_stage.run(storage, 3)
    assert (summary.records_in, summary.accepted, summary.quarantined) == (4, 2, 2)
    assert summary.reasons == {"reward: expected": 1, "rollout_id: invalid UTF-8": 1}
    assert read_accepted(storage, 3).column("rollout_id").to_pylist() == ["r3-0", "f-2"]


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), min_size=1, max_size=20))
def test_records_in_equals_accepted_plus_quarantined(tmp_path_factory, plan):
    tmp = tmp_path_factory.mktemp("prop")
    storage = Storage(tmp.as_uri())
    records = [good_record(i) if ok else bad_records()[kind] | {"rollout_id": f"bad-{i}"}
               for i, (ok, kind) in enumerate(plan)]
    summary = SnapshotWriter(storage).write_step(3, records, make_policy_dir(tmp / "p"), 3)
    validated = snapshot_stage.run(storage, 3)
    expected_good = sum(ok for ok, _ in plan)
    assert summary.accepted == validated.accepted == expected_good
    assert validated.accepted + validated.quarantined == len(records)
    q = pq.read_table(tmp / "snapshots/step=000003/quarantine.parquet", schema=QUARANTINE_SCHEMA)
    assert q.num_rows == len(records) - expected_good
