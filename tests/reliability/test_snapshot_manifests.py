"""Hostile manifests: the raw, validated and policy manifests of a written step replaced by
other JSON (a list, null, deep nesting, not JSON at all), stripped of fields, given fields
of the wrong type, other kinds and versions, odd file entries. A reader either refuses with
a SnapshotError or ManifestError naming the file, or, for a harmless change, reads on with
the counts adding up and every accepted record keeping the contract."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.layout import policy_prefix, raw_prefix, snapshot_prefix
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.policy import load_policy_ref
from pipeline.snapshot.stage import read_accepted

from .snapshot_reference import STEP, TALLY, contract_violations, expect_named_error

pytestmark = pytest.mark.integration

MANIFESTS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])
REFUSE, HARMLESS = "refuse", "harmless"
PREFIXES = {"raw": raw_prefix(STEP), "validated": snapshot_prefix(STEP),
            "policy": policy_prefix(STEP)}
NEEDED_META = {
    "raw": {"records_in": int, "policy_version": int, "policy_sha256": str,
            "tokenizer_fingerprint": str},
    "validated": {"accepted": int, "records_in": int, "policy_version": int,
                  "policy_sha256": str, "tokenizer_fingerprint": str},
    "policy": {"sha256": str, "vocab_size": int, "tokenizer_fingerprint": str},
}
HOSTILE = {  # JSON values of the wrong type or range for a field of each type
    int: [None, True, False, "3", 3.5, -1, 10**400, [], {}, [3]],
    str: [None, 1, True, "", [], {"a": "b"}],
}
WHOLE = [b"[]", b"null", b'"manifest"', b"3", b"true", b"{}", b"", b"\xff\xfe{",
         b"{", b"[" * 50_000 + b"]" * 50_000, b'{"kind": 1e400}', b"\x00" * 64]


def _top_level(m: dict, draw) -> tuple[dict, str]:
    name = draw(st.sampled_from(["kind", "kind_version", "files", "meta", "schema_version"]))
    if draw(st.booleans()):
        return {k: v for k, v in m.items() if k != name}, REFUSE
    value = draw(st.sampled_from([None, True, "x", 1.5, -1, 10**400, [], {}, [1], "\udcff",
                                  "rollout_snapshot", "policy_checkpoint", 0, 2, 1]))
    harmless = m[name] == value and type(m[name]) is type(value) or (
        name == "files" and value == [] and m["kind"] == "policy_checkpoint")
    return m | {name: value}, HARMLESS if harmless else REFUSE


def _meta(m: dict, draw, target: str) -> tuple[dict, str]:
    needed = NEEDED_META[target]
    name = draw(st.sampled_from(sorted(needed)))
    if draw(st.booleans()):
        return m | {"meta": {k: v for k, v in m["meta"].items() if k != name}}, REFUSE
    return m | {"meta": m["meta"] | {name: draw(st.sampled_from(HOSTILE[needed[name]]))}}, \
        REFUSE


def _extra_meta(m: dict, draw) -> tuple[dict, str]:
    value = draw(st.sampled_from([None, "x" * 10_000, [[[[1]]]], {"nested": {"deep": 1}}]))
    return m | {"meta": m["meta"] | {"note": value}}, HARMLESS


def _files(m: dict, draw, target: str) -> tuple[dict, str]:
    if target == "policy":  # the policy's files are read by capture, not by these readers
        return m | {"files": m["files"][:1]}, HARMLESS
    files = copy.deepcopy(m["files"])
    i = draw(st.integers(0, len(files) - 1))
    how = draw(st.sampled_from(["drop", "duplicate", "path", "bytes", "sha256", "rows",
                                "unknown key", "not an object", "missing file"]))
    if how == "drop":
        del files[i]
    elif how == "duplicate":
        files.append(files[i])
    elif how == "path":
        files[i]["path"] = draw(st.sampled_from(["../x.parquet", "/etc/passwd", "", ".",
                                                 "a/b.parquet", "_manifest.json",
                                                 "\udcff.parquet", "x" * 10_000]))
    elif how == "bytes":
        files[i]["bytes"] = draw(st.sampled_from([-1, 0, True, "12", 10**400, None]))
    elif how == "sha256":
        files[i]["sha256"] = draw(st.sampled_from(["0" * 64, "", 7, None]))
    elif how == "rows":  # rows are informative: the readers count what the files hold
        files[i]["rows"] = draw(st.sampled_from([None, 0, 10**6]))
        return m | {"files": files}, HARMLESS
    elif how == "unknown key":
        files[i]["owner"] = "someone"
    elif how == "not an object":
        files[i] = draw(st.sampled_from([None, "part-00000.parquet", [], 3]))
    else:
        files.append({**files[i], "path": "part-00077.parquet"})
    return m | {"files": files}, REFUSE


MUTATIONS = ["whole", "top level", "meta", "extra meta", "files"]


def _read(storage, target: str):
    if target == "raw":
        return snapshot_stage.run(storage, STEP)
    if target == "validated":
        return read_accepted(storage, STEP)
    return load_policy_ref(storage, STEP), snapshot_stage.run(storage, STEP)


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("target", sorted(PREFIXES))
@MANIFESTS
@given(data=st.data())
def test_hostile_manifests_are_refused_naming_the_file(fresh_copy, target, mutation, data):
    storage = fresh_copy()
    prefix = PREFIXES[target]
    key = f"{prefix}/_manifest.json"
    original = json.loads(storage.read_bytes(key))
    if mutation == "whole":
        text, verdict = data.draw(st.sampled_from(WHOLE)), REFUSE
    else:
        edit = {"top level": lambda m, d: _top_level(m, d),
                "meta": lambda m, d: _meta(m, d, target),
                "extra meta": lambda m, d: _extra_meta(m, d),
                "files": lambda m, d: _files(m, d, target)}[mutation]
        changed, verdict = edit(original, data.draw)
        text = json.dumps(changed).encode()
    storage.write_bytes(key, text)
    TALLY.cases += 1
    TALLY.classes[f"manifest: {target} {mutation}"] += 1
    try:
        result = _read(storage, target)
    except Exception as e:
        problem = expect_named_error(e, [prefix])
        assert problem is None, problem
        if verdict == HARMLESS:
            raise AssertionError(TALLY.fail(f"refused a harmless change: {e}",
                                            "wrongly_quarantined")) from e
        return
    if verdict == REFUSE:
        raise AssertionError(TALLY.fail(f"{target} manifest {text[:300]!r} was read: {result}",
                                        "silently_accepted"))
    accepted = read_accepted(storage, STEP).to_pylist()
    assert len(accepted) == 6 and not any(contract_violations(r) for r in accepted)
    TALLY.accepted += len(accepted)
