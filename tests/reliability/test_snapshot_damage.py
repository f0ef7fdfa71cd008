"""Damaged files: Parquet parts and quarantines of a written step bit-flipped, truncated,
zeroed, replaced by other bytes or by another valid file, emptied, grown or deleted, with
the manifest left as it was (storage damage) or re-hashed to match (a writer that wrote the
damage). The readers refuse naming the file, or read on with the counts adding up and no
record accepted that the trainer did not write."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.layout import raw_prefix, snapshot_prefix
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.stage import read_accepted

from .conftest import good_rows
from .snapshot_reference import STEP, TALLY, contract_violations, expect_named_error

pytestmark = pytest.mark.integration

DAMAGE = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow,
                                         HealthCheck.function_scoped_fixture])
TARGETS = {"raw part": (raw_prefix(STEP), "part-00000.parquet"),
           "raw quarantine": (raw_prefix(STEP), "quarantine.parquet"),
           "validated part": (snapshot_prefix(STEP), "accepted-00001.parquet")}
SWAP = {"part-00000.parquet": "part-00001.parquet",
        "quarantine.parquet": "part-00001.parquet",
        "accepted-00001.parquet": "accepted-00000.parquet"}
KINDS = ["flip", "truncate", "zero", "random bytes", "other file", "empty", "append", "delete"]


def _damage(data: bytes, kind: str, draw, other: bytes) -> bytes | None:
    if kind == "flip":
        out = bytearray(data)
        out[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "zero":
        start = draw(st.integers(0, len(data) - 1))
        return data[:start] + b"\0" * min(16, len(data) - start) + data[start + 16:]
    if kind == "random bytes":
        return draw(st.binary(min_size=1, max_size=len(data)))
    if kind == "other file":
        return other
    if kind == "empty":
        return b""
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    return None  # delete


def _rehash(storage, prefix: str, path: str, data: bytes) -> None:
    """Make the manifest describe ``data``, as a writer that wrote the damage would."""
    key = f"{prefix}/_manifest.json"
    manifest = json.loads(storage.read_bytes(key))
    for entry in manifest["files"]:
        if entry["path"] == path:
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    storage.write_bytes(key, json.dumps(manifest).encode())


# a deleted file has no bytes to re-hash
CASES = [(kind, rehash) for kind in KINDS for rehash in (False, True)
         if not (rehash and kind == "delete")]


@pytest.mark.parametrize("kind, rehash", CASES,
                         ids=[f"{k}-{'rehashed' if r else 'storage'}" for k, r in CASES])
@pytest.mark.parametrize("target", sorted(TARGETS))
@DAMAGE
@given(data=st.data())
def test_damaged_files_are_refused_or_read_honestly(fresh_copy, target, kind, rehash, data):
    storage = fresh_copy()
    prefix, path = TARGETS[target]
    original = storage.read_bytes(f"{prefix}/{path}")
    damaged = _damage(original, kind, data.draw, storage.read_bytes(f"{prefix}/{SWAP[path]}"))
    if damaged is None:
        storage.delete(f"{prefix}/{path}")
    else:
        storage.write_bytes(f"{prefix}/{path}", damaged)
        if rehash:
            _rehash(storage, prefix, path, damaged)
    TALLY.cases += 1
    TALLY.classes[f"damage: {target} {kind}{' rehashed' if rehash else ''}"] += 1
    try:
        if prefix == raw_prefix(STEP):
            summary = snapshot_stage.run(storage, STEP)
            assert summary.records_in == summary.accepted + summary.quarantined
        accepted = read_accepted(storage, STEP).to_pylist()
    except Exception as e:
        problem = expect_named_error(e, [prefix])
        assert problem is None, problem
        if not rehash and damaged != original:
            assert path in str(e), e  # the manifest's hash names the damaged file
        return
    if not rehash and damaged != original:
        raise AssertionError(TALLY.fail(f"{target} {kind}: damage went unnoticed",
                                        "silently_accepted"))
    written = {r["rollout_id"]: r for r in good_rows(6)}
    for rec in accepted:
        origin = written.get(rec["rollout_id"])
        same = origin is not None and all(rec[k] == v for k, v in origin.items())
        if contract_violations(rec) or not same:
            raise AssertionError(TALLY.fail(f"{target} {kind}: accepted {rec!r:.300}",
                                            "silently_accepted"))
    TALLY.accepted += len(accepted)
