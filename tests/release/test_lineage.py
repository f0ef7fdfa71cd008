"""Lineage tags: required keys, string values, no silent truncation."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.release.lineage import (
    MAX_TAG_VALUE,
    REQUIRED_LINEAGE_KEYS,
    LineageError,
    lineage_from_manifest,
    lineage_tags,
    parse_tag,
    read_lineage,
    tag_value,
    version_tags,
)
from tests.release.helpers import lineage


def test_tags_are_strings_and_parse_back():
    record = lineage("f" * 64, "file:///s/drafters/step=000010", tau=2.75)
    tags = lineage_tags(record)
    assert all(isinstance(v, str) for v in tags.values())
    assert set(REQUIRED_LINEAGE_KEYS) <= set(tags)
    assert parse_tag(tags["rl_step_window"]) == [8, 9, 10]
    assert parse_tag(tags["shard_manifest_sha256"])["9"] == f"{9:064x}"
    assert parse_tag(tags["tau"]) == 2.75 and tags["policy_uri"] == "file:///policy/10"
    assert math.isnan(parse_tag(tag_value(float("nan"))))


@pytest.mark.parametrize("key", REQUIRED_LINEAGE_KEYS)
def test_each_required_key_is_enforced(key):
    record = lineage("f" * 64, "file:///x")
    del record[key]
    with pytest.raises(LineageError, match=key):
        lineage_tags(record)
    with pytest.raises(LineageError, match=key):
        lineage_tags({**lineage("f" * 64, "file:///x"), key: ""})


def test_too_long_values_are_refused_not_truncated():
    with pytest.raises(LineageError, match="longer than"):
        lineage_tags({**lineage("f" * 64, "file:///x"), "note": "x" * (MAX_TAG_VALUE + 1)})


def test_lineage_from_a_drafter_manifest():
    meta = {"step": 12, "fingerprint": "abc", "window_steps": [10, 11, 12],
            "shard_manifest_sha256": {"10": "a", "11": "b", "12": "c"},
            "vocab_cache_key": "v", "coverage": 0.971234567, "policy_sha256": "p",
            "aux_layer_ids": [1, 3, 4]}
    tags = lineage_tags(lineage_from_manifest(
        meta, drafter_uri="s3://b/drafters/step=000012", policy_uri="s3://b/policies/step=000012",
        tau=3.123456789, alpha=(0.9, 0.654321), dagster_run_id="r1", heldout_key="h"))
    assert tags["vocab_mapping_key"] == "v" and tags["alpha"] == "[0.9,0.6543]"
    assert (tags["tau"], tags["coverage"]) == ("3.1235", "0.9712")  # shown rounded
    assert tags["heldout_key"] == "h" and tags["rl_step"] == "12"
    with pytest.raises(LineageError, match="policy_sha256"):
        lineage_from_manifest({**meta, "policy_sha256": None}, drafter_uri="u",
                              policy_uri="p", tau=1.0, alpha=(), dagster_run_id="r")


def test_a_version_shows_the_headline_and_one_lineage_record():
    meta = {"step": 12, "fingerprint": "abc", "window_steps": [10, 11, 12],
            "shard_manifest_sha256": {"10": "a"}, "vocab_cache_key": "v", "coverage": 0.5,
            "policy_sha256": "p", "aux_layer_ids": [1, 3, 4],
            "config": {"drafter_algorithm": "dflash"}}
    record = lineage_from_manifest(meta, drafter_uri="drafters/step=000012", policy_uri="p",
                                   tau=3.123456789, alpha=(0.9, math.nan), dagster_run_id="r1",
                                   heldout_key="1234")  # a string that reads as a number
    tags = lineage_tags(record)  # the training run's: one tag per key
    shown = version_tags(record)
    assert set(shown) == {"fingerprint", "algorithm", "rl_step", "tau", "lineage"}
    assert shown["algorithm"] == "dflash" and shown["tau"] == "3.1235"
    back = read_lineage(shown)
    assert back["heldout_key"] == "1234" and back["alpha"] == [0.9, None]  # strict JSON
    assert json.loads(shown["lineage"])  # no NaN in it
    old = read_lineage(tags)  # the old layout, a tag per key, reads the same otherwise
    assert {k: v for k, v in old.items() if k not in ("heldout_key", "alpha")} == \
        {k: v for k, v in back.items() if k not in ("heldout_key", "alpha")}
    assert back["rl_step_window"] == [10, 11, 12]
    assert back["shard_manifest_sha256"] == {"10": "a"}
    assert back["rl_step"] == 12 and back["drafter_uri"] == "drafters/step=000012"
    legacy = {**tags, "gate.1.decision": "refused", "gate.decision": "refused",
              "previous_champion": "none", "promoted_at": "t", "post_promotion.verdict": "ok"}
    assert read_lineage(legacy) == read_lineage(tags)  # decisions are not lineage
    with pytest.raises(LineageError, match="over a version tag"):
        version_tags({**record, "note": "x" * 100_001})
