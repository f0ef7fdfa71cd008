"""Schema 2's ``speculative`` counters: validated per record (the field named), carried to the
validated snapshot, and schema-1 snapshots still read (the column null)."""

from __future__ import annotations

import pytest

from pipeline.layout import raw_prefix, snapshot_prefix
from pipeline.parquet import read_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.schema import RecordError, validate_record
from pipeline.snapshot.sieve import SnapshotError
from pipeline.snapshot.stage import read_accepted
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage
from tests.snapshot.conftest import VOCAB, edit_manifest, good_record, rewrite_part

SGLANG = {"drafter_version": "3", "verify_ct": 10, "completion_tokens": 25}


RESPONSE = [4 + i % 40 for i in range(30)]  # room for SGLANG's 25 completion tokens


def _check(spec, response=RESPONSE):
    return validate_record({**good_record(0), "response_token_ids": response,
                            "speculative": spec}, vocab_size=VOCAB,
                           defaults={"policy_uri": "policies/step=000003"})


def test_counters_are_kept_with_the_unreported_ones_null():
    assert _check(SGLANG)["speculative"] == {**SGLANG, "accepted_tokens": None,
                                             "draft_tokens": None}
    slime = {"drafter_version": 7, "verify_ct": 4, "accepted_tokens": 6, "draft_tokens": 12}
    assert _check(slime)["speculative"]["drafter_version"] == "7"  # MLflow numbers them
    assert _check(None)["speculative"] is None


@pytest.mark.parametrize("spec, field, words", [
    ({"verify_ct": 3, "completion_tokens": 4}, "speculative.drafter_version", "missing"),
    ({**SGLANG, "verify_ct": None}, "speculative.verify_ct", "missing"),
    ({**SGLANG, "verify_ct": -1}, "speculative.verify_ct", "below 0"),
    ({**SGLANG, "verify_ct": True}, "speculative.verify_ct", "expected an integer"),
    ({**SGLANG, "completion_tokens": 10}, "speculative.completion_tokens", "each emits"),
    ({"drafter_version": "3", "verify_ct": 2}, "speculative", "completion_tokens or "),
    ({**SGLANG, "accepted_tokens": 5, "draft_tokens": 4}, "speculative.accepted_tokens",
     "5 accepted of 4"),
    ({**SGLANG, "spec_verify_ct": 1}, "speculative", "unknown key"),
    ({**SGLANG, "drafter_version": " "}, "speculative.drafter_version", "empty"),
    ("3", "speculative", "expected a mapping"),
    # counters that contradict their definitions
    ({**SGLANG, "accepted_tokens": 25}, "speculative.accepted_tokens",
     "25 accepted of 24 emitted after the prefill token"),
    ({"drafter_version": "3", "verify_ct": 0, "accepted_tokens": 7},
     "speculative.accepted_tokens", "7 without a verify pass"),
    ({"drafter_version": "3", "verify_ct": 0, "accepted_tokens": 0, "draft_tokens": 9},
     "speculative.draft_tokens", "9 without a verify pass"),
    ({**SGLANG, "verify_ct": 0}, "speculative.completion_tokens",
     "25 tokens without a verify pass"),
    ({**SGLANG, "drafter_version": "none"}, "speculative.verify_ct",
     "10 verify passes with drafter_version 'none'"),
])
def test_bad_counters_name_the_field(spec, field, words):
    with pytest.raises(RecordError) as err:
        _check(spec)
    assert err.value.field == field and words in err.value.reason, err.value


@pytest.mark.parametrize("spec, field", [
    ({**SGLANG, "completion_tokens": 31}, "speculative.completion_tokens"),
    ({"drafter_version": "3", "verify_ct": 10, "accepted_tokens": 20},
     "speculative.accepted_tokens"),
    ({"drafter_version": "3", "verify_ct": 2, "completion_tokens": 10 ** 17},
     "speculative.completion_tokens"),
])
def test_counters_claiming_more_tokens_than_the_response_holds_are_refused(spec, field):
    """What verify passes emitted is part of the response: a rollout cannot claim more."""
    with pytest.raises(RecordError) as err:
        _check(spec)
    assert err.value.field == field and "but the response holds 30" in err.value.reason
    assert _check({**SGLANG, "completion_tokens": 30})  # every response token counted
    assert _check({"drafter_version": "3", "verify_ct": 10, "accepted_tokens": 19})


def test_counters_without_response_ids_are_checked_against_their_definitions_only():
    retokenized = {**good_record(0), "token_fidelity": "retokenized",
                   "response_token_ids": None, "speculative": SGLANG}
    assert validate_record(retokenized, vocab_size=VOCAB,
                           defaults={"policy_uri": "policies/step=000003"})["speculative"]


def test_counters_reach_the_validated_snapshot_and_bad_ones_are_quarantined(tmp_path,
                                                                           policy_dir):
    storage = Storage(str(tmp_path / "store"))
    records = [{**good_record(0), "response_token_ids": RESPONSE, "speculative": SGLANG},
               good_record(1),
               {**good_record(2), "response_token_ids": RESPONSE,
                "speculative": {**SGLANG, "verify_ct": 99}}]
    summary = SnapshotWriter(storage).write_step(3, records, policy_dir, 3)
    assert (summary.accepted, summary.quarantined) == (2, 1)
    assert summary.reasons == {"speculative.completion_tokens: 25 tokens from 99 verify "
                               "passes (each emits >= 1, after the prefill token)": 1}
    snapshot_stage.run(storage, 3)
    column = read_accepted(storage, 3).column("speculative").to_pylist()
    assert column == [{**SGLANG, "accepted_tokens": None, "draft_tokens": None}, None]


def test_the_prefill_token_counts_toward_completion_tokens():
    assert _check({**SGLANG, "completion_tokens": 11})["speculative"]["verify_ct"] == 10
    assert _check({**SGLANG, "verify_ct": 0, "completion_tokens": 1})  # stopped at prefill


def test_a_schema_2_part_without_the_column_is_refused(tmp_path, policy_dir):
    storage = Storage(str(tmp_path / "store"))
    SnapshotWriter(storage).write_step(3, [good_record(i) for i in range(3)], policy_dir, 3)
    snapshot_stage.run(storage, 3)
    prefix, path = snapshot_prefix(3), "accepted-00000.parquet"
    table = read_table(storage, f"{prefix}/{path}")
    rewrite_part(storage, prefix, path, table.drop_columns(["speculative"]))
    with pytest.raises(SnapshotError, match="schema mismatch"):
        read_accepted(storage, 3)


def test_a_schema_1_snapshot_is_still_read(tmp_path, policy_dir):
    """A snapshot an older release wrote (no ``speculative`` column, schema version 1) is
    validated and read as before, its counters null."""
    storage = Storage(str(tmp_path / "store"))
    SnapshotWriter(storage).write_step(3, [good_record(i) for i in range(3)], policy_dir, 3)
    _as_schema_1(storage, raw_prefix(3), "part-00000.parquet")
    summary = snapshot_stage.run(storage, 3)
    assert (summary.accepted, summary.quarantined) == (3, 0)
    _as_schema_1(storage, snapshot_prefix(3), "accepted-00000.parquet")
    table = read_accepted(storage, 3)
    assert table.num_rows == 3
    assert table.column("speculative").to_pylist() == [None] * 3


def _as_schema_1(storage, prefix: str, path: str) -> None:
    table = read_table(storage, f"{prefix}/{path}")
    rewrite_part(storage, prefix, path, table.drop_columns(["speculative"])
                 .replace_schema_metadata({**table.schema.metadata,
                                           b"aerie.schema_version": b"1"}))
    edit_manifest(storage, prefix, lambda m: m | {"kind_version": 1})
