"""What the readers refuse: malformed manifests and meta, other kinds and versions, damaged
files. Every refusal is a SnapshotError whose message names the file and the field."""

from __future__ import annotations

import json
from dataclasses import asdict

import pyarrow as pa
import pytest

from pipeline.layout import policy_prefix, raw_prefix, snapshot_prefix
from pipeline.manifest import ManifestError, entry_for
from pipeline.parquet import read_table, write_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.policy import load_policy_ref
from pipeline.snapshot.schema import ROLLOUT_SCHEMA
from pipeline.snapshot.sieve import SnapshotError
from pipeline.snapshot.stage import read_accepted
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

from .conftest import edit_manifest, good_record, replace_json, rewrite_part

STEP = 3


@pytest.fixture
def local(tmp_path, policy_dir) -> Storage:
    """A local storage holding step 3, written and validated."""
    storage = Storage(str(tmp_path / "store"))
    SnapshotWriter(storage).write_step(STEP, [good_record(i) for i in range(4)], policy_dir, STEP)
    snapshot_stage.run(storage, STEP)
    return storage


READERS = {
    "stage": (raw_prefix(STEP), lambda s: snapshot_stage.run(s, STEP)),
    "read_accepted": (snapshot_prefix(STEP), lambda s: read_accepted(s, STEP)),
    "load_policy_ref": (policy_prefix(STEP), lambda s: load_policy_ref(s, STEP)),
}


def refused(storage, reader, field, prefix=None):
    """The error ``reader`` raises, checked to name ``prefix``'s manifest and ``field``."""
    own_prefix, read = READERS[reader]
    with pytest.raises(SnapshotError) as err:
        read(storage)
    assert f"{prefix or own_prefix}/_manifest.json" in str(err.value), err.value
    assert field in str(err.value), err.value
    # either the manifest's parser refused it (chained from its ManifestError) or the reader's
    # own check did, outside any handler: never another error caught and re-raised unnamed
    cause, context = err.value.__cause__, err.value.__context__
    assert isinstance(cause, ManifestError) or (cause is None and context is None), (
        f"{type(err.value).__name__} raised while handling {context!r}")
    return err.value


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("value", [[], None, "manifest", 3, [{"kind": "x"}]], ids=repr)
def test_a_manifest_that_is_not_an_object_is_refused(local, reader, value):
    replace_json(local, f"{READERS[reader][0]}/_manifest.json", value)
    refused(local, reader, "expected an object")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_manifest_that_is_not_json_is_refused(local, reader):
    local.write_bytes(f"{READERS[reader][0]}/_manifest.json", b"\xff{not json")
    refused(local, reader, "not JSON")


@pytest.mark.parametrize("reader", ["stage", "read_accepted"])
@pytest.mark.parametrize("name", ["records_in", "policy_sha256", "policy_version",
                                  "tokenizer_fingerprint"])
def test_missing_meta_is_refused_naming_it(local, reader, name):
    edit_manifest(local, READERS[reader][0],
                  lambda m: m | {"meta": {k: v for k, v in m["meta"].items() if k != name}})
    assert refused(local, reader, f"meta.{name}").field == f"meta.{name}"


@pytest.mark.parametrize("reader", ["stage", "read_accepted"])
@pytest.mark.parametrize("name, value", [
    ("records_in", True), ("records_in", "4"), ("records_in", 4.0), ("records_in", None),
    ("records_in", -1), ("records_in", 10**400), ("policy_sha256", 7),
    ("policy_sha256", ["a"]), ("policy_version", False), ("policy_version", STEP + 1),
    ("tokenizer_fingerprint", {}), ("policy_sha256", ""),
], ids=lambda v: repr(v)[:20])
def test_meta_of_the_wrong_type_or_range_is_refused(local, reader, name, value):
    edit_manifest(local, READERS[reader][0], lambda m: m | {"meta": m["meta"] | {name: value}})
    refused(local, reader, f"meta.{name}")


@pytest.mark.parametrize("value", [True, False, "100", 100.0, 0, -5, 2**40, None, [100]],
                         ids=repr)
def test_a_policy_vocab_size_that_is_not_a_positive_int_is_refused(local, value):
    edit_manifest(local, policy_prefix(STEP),
                  lambda m: m | {"meta": m["meta"] | {"vocab_size": value}})
    refused(local, "load_policy_ref", "meta.vocab_size")
    refused(local, "stage", "meta.vocab_size", policy_prefix(STEP))  # and the step using it


@pytest.mark.parametrize("reader, kind", [
    ("stage", "rollout_snapshot"), ("stage", "policy_checkpoint"),
    ("read_accepted", "rollout_snapshot_raw"), ("load_policy_ref", "rollout_snapshot")])
def test_a_manifest_of_another_kind_is_refused(local, reader, kind):
    edit_manifest(local, READERS[reader][0], lambda m: m | {"kind": kind})
    refused(local, reader, "kind")


READABLE = {"stage": "[1, 2]", "read_accepted": "[1, 2]", "load_policy_ref": "[1]"}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("version", [0, 3, 99])
def test_a_manifest_of_another_kind_version_is_refused_listing_ours(local, reader, version):
    edit_manifest(local, READERS[reader][0], lambda m: m | {"kind_version": version})
    err = refused(local, reader, "kind_version")
    assert READABLE[reader] in str(err)


@pytest.mark.parametrize("reader", ["stage", "read_accepted"])
@pytest.mark.parametrize("path", ["../x.parquet", "a/b.parquet", "", ".hidden",
                                  "_manifest.json"])
def test_file_entries_must_be_plain_names(local, reader, path):
    def add(m):
        m["files"].append({**m["files"][0], "path": path})
        return m

    edit_manifest(local, READERS[reader][0], add)
    refused(local, reader, "files[")


def test_a_raw_manifest_must_list_its_quarantine(local):
    edit_manifest(local, raw_prefix(STEP), lambda m: m | {
        "files": [f for f in m["files"] if f["path"] != "quarantine.parquet"]})
    refused(local, "stage", "quarantine.parquet")


def _claiming(table: pa.Table, kind: bytes | None, version: bytes | None) -> pa.Table:
    meta = {k: v for k, v in (table.schema.metadata or {}).items()
            if not k.startswith(b"aerie.")}
    meta |= {b"aerie.kind": kind} if kind is not None else {}
    meta |= {b"aerie.schema_version": version} if version is not None else {}
    return table.replace_schema_metadata(meta)


@pytest.mark.parametrize("reader, path", [("stage", "part-00000.parquet"),
                                          ("read_accepted", "accepted-00000.parquet")])
@pytest.mark.parametrize("kind, version, field", [
    (b"rollout_snapshot", b"3", "aerie.schema_version"),
    (b"rollout_snapshot", b"0", "aerie.schema_version"),
    (b"rollout_snapshot", None, "aerie.schema_version"),
    (b"rollout_snapshot", b"\xff", "aerie.schema_version"),
    (b"tokenized_samples", b"1", "aerie.kind"),
    (None, b"1", "aerie.kind"),
])
def test_parts_claiming_another_kind_or_version_are_refused(local, reader, path, kind,
                                                            version, field):
    prefix = READERS[reader][0]
    table = read_table(local, f"{prefix}/{path}")
    rewrite_part(local, prefix, path, _claiming(table, kind, version))
    _, read = READERS[reader]
    with pytest.raises(SnapshotError) as err:
        read(local)
    assert path in str(err.value) and field in str(err.value)
    assert err.value.field == field
    if field == "aerie.schema_version":
        assert "reads (1, 2)" in str(err.value)


def test_a_validated_part_claiming_nothing_is_refused(local):
    prefix = snapshot_prefix(STEP)
    table = read_table(local, f"{prefix}/accepted-00000.parquet")
    rewrite_part(local, prefix, "accepted-00000.parquet", table.replace_schema_metadata({}))
    with pytest.raises(SnapshotError, match="accepted-00000.parquet: aerie.kind: absent"):
        read_accepted(local, STEP)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "replace"])
def test_damaged_validated_files_are_refused_naming_them(local, damage):
    key = f"{snapshot_prefix(STEP)}/accepted-00000.parquet"
    data = bytearray(local.read_bytes(key))
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    if damage == "truncate":
        data = data[:-9]
    if damage == "replace":
        data = local.read_bytes(f"{raw_prefix(STEP)}/quarantine.parquet")
    if damage == "delete":
        local.delete(key)
    else:
        local.write_bytes(key, bytes(data))
    with pytest.raises(SnapshotError, match="accepted-00000.parquet"):
        read_accepted(local, STEP)


def test_accepted_rows_must_match_the_manifest(local):
    prefix = snapshot_prefix(STEP)
    table = read_table(local, f"{prefix}/accepted-00000.parquet")
    rewrite_part(local, prefix, "accepted-00000.parquet", table.slice(0, 2))
    with pytest.raises(SnapshotError, match="meta.accepted: 4 records, the files hold 2"):
        read_accepted(local, STEP)


def test_a_validated_snapshot_without_accepted_files_is_empty_not_a_crash(local):
    prefix = snapshot_prefix(STEP)
    edit_manifest(local, prefix, lambda m: m | {
        "files": [f for f in m["files"] if not f["path"].startswith("accepted-")],
        "meta": m["meta"] | {"accepted": 0}})
    assert read_accepted(local, STEP).schema == ROLLOUT_SCHEMA
    assert read_accepted(local, STEP).num_rows == 0


def test_a_miscounted_raw_snapshot_names_its_manifest(local):
    edit_manifest(local, raw_prefix(STEP), lambda m: m | {"meta": m["meta"] | {"records_in": 9}})
    err = refused(local, "stage", "meta.records_in")
    assert "9 records written but 4 accepted + 0 quarantined" in str(err)


def test_refusals_keep_the_manifest_error_message(local):
    replace_json(local, f"{raw_prefix(STEP)}/_manifest.json", None)
    err = refused(local, "stage", "expected an object")
    assert str(err) == str(err.__cause__) and err.url.endswith("_manifest.json")
    json.dumps(str(err))


def test_a_validated_manifest_lists_its_quarantine_and_parts_only(local):
    prefix = snapshot_prefix(STEP)
    edit_manifest(local, prefix, lambda m: m | {
        "files": [f for f in m["files"] if f["path"] != "quarantine.parquet"]})
    refused(local, "read_accepted", "quarantine.parquet is not listed")
    edit_manifest(local, prefix, lambda m: m | {
        "files": [*m["files"], {**m["files"][0], "path": "quarantine.parquet"},
                  {**m["files"][0], "path": "part-00000.parquet"}]})
    refused(local, "read_accepted", "part-00000.parquet is not a file of a validated snapshot")


def test_rows_python_cannot_hold_are_quarantined_one_by_one(local):
    """A timestamp beyond Python's datetime fails Arrow's conversion of its whole batch: the
    other rows are still read, the row itself is quarantined."""
    prefix = raw_prefix(STEP)
    uri = local.url(policy_prefix(STEP))
    foreign = pa.table({
        "rollout_id": ["t-0", "t-1"], "trainer_step": [STEP, STEP],
        "generated_by_policy_version": [STEP, STEP], "policy_uri": [uri, uri],
        "prompt": ["q", "q"], "response_token_ids": [[1], [2]],
        "token_fidelity": ["retokenized", "retokenized"],
        "when": pa.array([None, 2**62], pa.timestamp("ms"))})
    written = write_table(local, f"{prefix}/part-00009.parquet", foreign)

    def add(m):
        m["files"].append(asdict(entry_for(prefix, written, rows=2)))
        m["meta"]["records_in"] += 2
        return m

    edit_manifest(local, prefix, add)
    summary = snapshot_stage.run(local, STEP)
    assert (summary.accepted, summary.quarantined) == (4, 2)
    assert summary.reasons == {"when: unknown": 1, "<record>: unreadable": 1}
    rows = read_table(local, f"{snapshot_prefix(STEP)}/quarantine.parquet").to_pylist()
    assert rows[1]["row"] == 1 and "unreadable row" in rows[1]["reason"]
