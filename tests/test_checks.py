"""The stage checks of :mod:`pipeline.checks` against hand-built inputs: each passes on good
input and fails, saying why, on the failure it exists to catch."""

from __future__ import annotations

import math

import pytest

from pipeline.checks import evaluation_sound, shard_integrity, training_loss, vocab_coverage
from pipeline.contracts import Manifest
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.stage import AcceptanceReport, Contestant
from pipeline.layout import shards_prefix
from pipeline.manifest import entry_for, write_manifest
from pipeline.storage import Storage


@pytest.fixture
def store(tmp_path) -> Storage:
    return Storage(tmp_path.as_uri())


def _shards(store: Storage, step: int, blobs: list[bytes]) -> list[str]:
    prefix = shards_prefix(step)
    written = [store.write_bytes(f"{prefix}/shard-{i:05d}.parquet", b)
               for i, b in enumerate(blobs)]
    write_manifest(store, prefix, Manifest(kind="shards", kind_version=1,
                                           files=tuple(entry_for(prefix, w) for w in written)))
    return [w.key for w in written]


def test_shard_integrity_passes_intact_shards(store):
    _shards(store, 3, [b"a" * 100, b"b" * 50])
    outcome = shard_integrity(store, 3)
    assert outcome.passed and outcome.metadata == {"files": 2, "problems": 0}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_shard_integrity_catches_damage_after_commit(store, damage):
    keys = _shards(store, 3, [b"a" * 100, b"b" * 50])
    path = store.local_path(keys[1])
    data = path.read_bytes()
    if damage == "flip":
        path.write_bytes(data[:10] + b"X" + data[11:])  # same size, different bytes
    elif damage == "truncate":
        path.write_bytes(data[:-1])
    else:
        path.unlink()
    outcome = shard_integrity(store, 3)
    assert not outcome.passed and outcome.metadata["problems"] == 1
    assert "shard-00001.parquet" in outcome.description


def test_shard_integrity_fails_without_a_manifest(store):
    outcome = shard_integrity(store, 4)
    assert not outcome.passed and "no committed manifest" in outcome.description


@pytest.mark.parametrize(("coverage", "passed"), [(0.95, True), (0.9, True), (0.89, False),
                                                  (math.nan, False)])
def test_vocab_coverage_threshold(coverage, passed):
    assert vocab_coverage(coverage, 0.9).passed is passed


@pytest.mark.parametrize(("first", "final", "history", "passed", "finite"), [
    (5.0, 3.0, [5.0, 4.0, 3.0], True, True),
    (5.0, 5.0, [5.0, 5.0], False, True),  # flat: learned nothing
    (5.0, 6.0, [5.0, 6.0], False, True),
    (5.0, math.nan, [5.0, math.nan], False, False),  # diverged
    (5.0, 3.0, [5.0, math.inf, 3.0], False, False),  # one bad step in the middle
])
def test_training_loss(first, final, history, passed, finite):
    outcome = training_loss(first, final, history)
    assert outcome.passed is passed and outcome.metadata["finite"] is finite


def _report(matches: dict[str, int], cycles: int = 10, prompts: int = 4) -> AcceptanceReport:
    stats = AcceptanceStats(num_steps=3, prompts=prompts)
    for _ in range(cycles):
        stats.add_cycle(2, 3, bonus=True)  # two of three drafts accepted, plus the bonus
    contestants = {n: Contestant(n, None, None, stats.to_dict(), m) for n, m in matches.items()}
    return AcceptanceReport(step=1, policy_uri="", policy_sha256="",
                            heldout={"prompts": prompts}, settings={}, heldout_key="h",
                            settings_key="s", contestants=contestants, fingerprint="f",
                            seconds=0.0)


def test_evaluation_sound_passes_lossless_measured_contestants():
    assert evaluation_sound(_report({"candidate": 4, "champion": 4, "no_drafter": 4})).passed


def test_evaluation_sound_fails_on_one_lossy_prompt():
    outcome = evaluation_sound(_report({"candidate": 3, "no_drafter": 4}))
    assert not outcome.passed and "candidate: 3/4 prompts" in outcome.description


def test_evaluation_sound_fails_on_an_unmeasured_drafter():
    outcome = evaluation_sound(_report({"candidate": 4, "no_drafter": 4}, cycles=0))
    assert not outcome.passed and "0 cycles" in outcome.description
