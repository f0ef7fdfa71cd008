"""The stage checks of :mod:`pipeline.checks` against hand-built inputs: each passes on good
input and fails, saying why, on the failure it exists to catch."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pipeline.checks import (
    ServingState,
    evaluation_sound,
    serving_staleness,
    shard_integrity,
    staleness,
    training_loss,
    vocab_coverage,
)
from pipeline.contracts import Manifest
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.stage import EVAL_KIND, REPORT_FILE, AcceptanceReport, Contestant
from pipeline.layout import drafter_prefix, eval_prefix, shards_prefix
from pipeline.manifest import entry_for, write_manifest
from pipeline.records import RecordError, to_dict, to_json
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import ServingTarget
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


def _report(matches: dict[str, int], cycles: int = 10, prompts: int = 4,
            reference: dict[str, int] | None = None, sampled: int = 2) -> AcceptanceReport:
    """``matches``: prompts matching the baseline per contestant; ``reference``: sampled
    prompts matching the cache-free reference (default: all ``sampled``)."""
    stats = AcceptanceStats(num_steps=3, prompts=prompts)
    for _ in range(cycles):
        stats.add_cycle(2, 3, bonus=True)  # two of three drafts accepted, plus the bonus
    reference = reference or {}
    contestants = {n: Contestant(n, None, None, to_dict(stats), m, reference.get(n, sampled))
                   for n, m in matches.items()}
    return AcceptanceReport(step=1, policy_uri="", policy_sha256="",
                            heldout={"prompts": prompts}, settings={}, heldout_key="h",
                            settings_key="s", contestants=contestants, fingerprint="f",
                            seconds=0.0, reference={"prompts": sampled, "indices": [0, 3]})


def test_evaluation_sound_passes_lossless_measured_contestants():
    assert evaluation_sound(_report({"candidate": 4, "champion": 4, "no_drafter": 4})).passed


def test_evaluation_sound_fails_on_one_lossy_prompt():
    outcome = evaluation_sound(_report({"candidate": 3, "no_drafter": 4}))
    assert not outcome.passed and "candidate: 3/4 prompts" in outcome.description


def test_evaluation_sound_fails_when_the_engine_agrees_with_itself_but_not_the_reference():
    """Every contestant equals the engine's baseline, yet the baseline (and so everyone)
    differs from the cache-free reference on one sampled prompt: an engine bug."""
    outcome = evaluation_sound(_report({"candidate": 4, "no_drafter": 4},
                                       reference={"candidate": 1, "no_drafter": 1}))
    assert not outcome.passed
    assert "no_drafter: 1/2 sampled prompts match the cache-free reference" in \
        outcome.description


def test_evaluation_sound_counts_bf16_near_ties_but_not_a_real_mismatch_beside_one():
    tied = _report({"candidate": 3, "no_drafter": 4}, reference={"candidate": 1})
    tied = replace(tied, dtype="bfloat16", contestants={
        **tied.contestants, "candidate": replace(tied.contestants["candidate"], ties=2)})
    outcome = evaluation_sound(tied)
    assert outcome.passed and "2 divergences at bfloat16 near-ties" in outcome.description
    # one tie does not cover two mismatches: the reference one is real
    one = replace(tied, contestants={
        **tied.contestants, "candidate": replace(tied.contestants["candidate"], ties=1)})
    outcome = evaluation_sound(one)
    assert not outcome.passed and "1 diverged at bfloat16 near-ties" in outcome.description


def test_reports_from_before_the_sampler_read_as_greedy_and_every_prompt_checked():
    from pipeline.evaluation.regime import sampler_key
    from pipeline.records import from_json
    from pipeline.sampling import GREEDY

    old = json.loads(to_json(_report({"candidate": 4, "no_drafter": 4})))
    for name in ("sampler", "sampler_source", "sampler_key", "seed", "lossless_prompts",
                 "confidence", "device", "dtype"):
        old.pop(name)
    for c in old["contestants"].values():
        for name in ("per_prompt", "tau_interval", "ties"):
            c.pop(name)
    report = from_json(AcceptanceReport, json.dumps({**old, "schema_version": 2}))
    assert report.regime == "greedy" and report.sampler_key == sampler_key(GREEDY)
    assert report.checked_prompts == 4 and evaluation_sound(report).passed
    with pytest.raises(RecordError, match="schema_version 9"):
        from_json(AcceptanceReport, json.dumps({**old, "schema_version": 9}))


def test_evaluation_sound_fails_on_an_unmeasured_drafter():
    outcome = evaluation_sound(_report({"candidate": 4, "no_drafter": 4}, cycles=0))
    assert not outcome.passed and "0 cycles" in outcome.description


# -- staleness of the serving drafter --------------------------------------------------------

def _state(window_end=4, at_promotion=2.5, last=2.5, last_step=4) -> ServingState:
    return ServingState("3", drafter_prefix(window_end), window_end, at_promotion, last,
                        last_step)


@pytest.mark.parametrize(("state", "newest", "passed", "why"), [
    (None, 40, True, "no drafter is serving"),
    (_state(), 6, True, "2 RL steps past its window"),
    (_state(), 12, True, "8 RL steps"),  # exactly the threshold: not yet stale
    (_state(), 13, False, "9 RL steps past its training window"),
    (_state(last=2.3, last_step=8), 8, True, "τ 2.300"),  # -8%: within 10%
    (_state(last=2.2, last_step=8), 8, False, "τ fell 12.0% since promotion"),
    (_state(last=3.0, last_step=8), 8, True, "τ 3.000"),  # better than at promotion
    (_state(at_promotion=None), 8, True, "4 RL steps"),  # forced in, never measured
    (_state(), None, True, "0 RL steps"),  # nothing ingested (yet)
])
def test_staleness(state, newest, passed, why):
    outcome = staleness(state, newest, stale_after_steps=8, max_tau_drop=0.10)
    assert outcome.passed is passed and why in outcome.description, outcome.description


def test_staleness_reports_both_problems_with_their_numbers():
    outcome = staleness(_state(last=1.5, last_step=16), 20, stale_after_steps=8,
                        max_tau_drop=0.10)
    assert not outcome.passed
    assert "16 RL steps past" in outcome.description and "τ fell 40.0%" in outcome.description
    assert outcome.metadata["steps_behind"] == 16 and outcome.metadata["newest_step"] == 20
    assert outcome.metadata["tau_drop"] == pytest.approx(0.4)


def _stats(*accepted: int) -> dict:
    stats = AcceptanceStats(num_steps=3, prompts=1)
    for a in accepted:
        stats.add_cycle(a, min(a + 1, 3), bonus=True)
    return to_dict(stats)


def _publish_report(store: Storage, step: int, contestants: dict[str, tuple[str, dict]],
                    sampler_key: str = "T=1"):
    report = AcceptanceReport(
        step=step, policy_uri="", policy_sha256="", heldout={"prompts": 1}, settings={},
        heldout_key="h", settings_key="s", fingerprint=f"report-{step}", seconds=0.0,
        contestants={n: Contestant(n, None, fp, stats, 1)
                     for n, (fp, stats) in contestants.items()}, sampler_key=sampler_key)
    prefix = eval_prefix(step)
    written = store.write_bytes(f"{prefix}/{REPORT_FILE}", to_json(report).encode())
    write_manifest(store, prefix, Manifest(kind=EVAL_KIND, kind_version=1,
                                           files=(entry_for(prefix, written),)))


def _serve(store: Storage, step: int, window: list[int], fingerprint: str) -> str:
    """A published drafter of refresh ``step`` that serving now points at."""
    write_manifest(store, drafter_prefix(step), Manifest(
        kind="drafter_checkpoint", kind_version=1, files=(),
        meta={"window_steps": window, "fingerprint": fingerprint}))
    ledger = ServingLedger(store, "aerie-drafter-test")
    ledger.publish(ServingTarget(store.url(drafter_prefix(step)), fingerprint, ledger.name,
                                 "2"), SpecParams(3, 1, 4), mode="manifest", reason="test")
    return ledger.name


def test_serving_staleness_reads_the_window_and_the_taus_from_storage(store):
    name = _serve(store, 4, [1, 2, 3, 4], "fp-served")
    _publish_report(store, 4, {"candidate": ("fp-served", _stats(2, 1)),  # τ 2.5
                               "no_drafter": (None, _stats(0))})
    _publish_report(store, 8, {"candidate": ("fp-new", _stats(3, 3)),  # a refused candidate
                               "champion": ("fp-served", _stats(1, 1, 1, 1))})  # τ 2.0
    _publish_report(store, 12, {"candidate": ("fp-newer", _stats(2))})  # no champion here
    fresh = serving_staleness(store, name, 12, stale_after_steps=8, max_tau_drop=0.5)
    assert fresh.passed, fresh.description
    assert (fresh.metadata["window_end"], fresh.metadata["steps_behind"]) == (4, 8)
    assert (fresh.metadata["tau_at_promotion"], fresh.metadata["last_tau"],
            fresh.metadata["last_tau_step"]) == (2.5, 2.0, 8)
    stale = serving_staleness(store, name, 13, stale_after_steps=8, max_tau_drop=0.1)
    assert not stale.passed
    assert "9 RL steps past" in stale.description and "τ fell 20.0%" in stale.description


def test_staleness_compares_taus_of_one_regime_only(store):
    """A greedy report after a sampled promotion is neither a drop nor a rise: the newest
    report of the promotion's regime is the last τ."""
    name = _serve(store, 4, [1, 2, 3, 4], "fp-served")
    _publish_report(store, 4, {"candidate": ("fp-served", _stats(2, 1))})  # τ 2.5, T=1
    _publish_report(store, 8, {"champion": ("fp-served", _stats(1, 1))})  # τ 2.0, T=1
    _publish_report(store, 12, {"champion": ("fp-served", _stats(3, 3))}, sampler_key="greedy")
    outcome = serving_staleness(store, name, 12, stale_after_steps=8, max_tau_drop=0.5)
    assert (outcome.metadata["last_tau"], outcome.metadata["last_tau_step"]) == (2.0, 8)


def test_staleness_measured_since_only_in_another_regime_cannot_judge_a_drop(store):
    name = _serve(store, 4, [1, 2, 3, 4], "fp-served")
    _publish_report(store, 4, {"candidate": ("fp-served", _stats(2, 1))})  # τ 2.5, T=1
    _publish_report(store, 8, {"champion": ("fp-served", _stats(0, 0))}, sampler_key="greedy")
    outcome = serving_staleness(store, name, 8, stale_after_steps=8, max_tau_drop=0.1)
    assert outcome.metadata.get("last_tau") is None and outcome.passed


def test_serving_staleness_without_a_readable_serving_drafter(store):
    assert serving_staleness(store, "aerie-drafter-test", 50).passed  # nothing served
    ledger = ServingLedger(store, "aerie-drafter-test")
    ledger.publish(ServingTarget("s3://elsewhere/drafters/step=000004", "fp", ledger.name,
                                 "1"), SpecParams(3, 1, 4), mode="manifest", reason="test")
    outcome = serving_staleness(store, ledger.name, 5)
    assert not outcome.passed and "staleness unknown" in outcome.description
