"""Canary verdicts from the RL engine's counters: wait, promote or roll back, and the
interval that pairs the two drafters by RL step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.evaluation.confidence import stratified_gain_interval, tau_interval
from pipeline.monitor.canary import PROMOTE, ROLL_BACK, WAIT, CanaryPolicy, judge_canary
from pipeline.monitor.observed import summarise

POLICY = CanaryPolicy(canary_steps=3, min_verify_passes=100)


def rollouts(version: str, tau: float, n: int, passes: int, rng) -> list[dict]:
    """``n`` rollouts of ``version``, each of ``passes`` verify passes emitting about
    ``tau`` tokens per pass."""
    out = []
    for _ in range(n):
        emitted = max(passes, int(round(rng.normal(tau, 0.15) * passes)))
        out.append({"drafter_version": version, "verify_ct": passes,
                    "accepted_tokens": emitted - passes})
    return out


def step(s: int, taus: dict[str, float], rng, n: int = 12, passes: int = 10):
    counters = [c for v, t in taus.items() for c in rollouts(v, t, n, passes, rng)]
    return summarise(s, counters)


def series(taus_per_step: list[dict[str, float]], first: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [step(first + i, taus, rng) for i, taus in enumerate(taus_per_step)]


def test_a_better_canary_is_promoted_on_the_pooled_counts():
    observed = series([{"5": 2.4, "4": 2.0}] * 4)
    verdict = judge_canary(observed, "5", "4", started_at=10, policy=POLICY)
    assert verdict.action == PROMOTE and verdict.reason.startswith("canary v5 beats v4: τ ")
    e = verdict.evidence
    assert e.steps == (10, 11, 12, 13)
    emitted = sum(o.of("5").emitted for o in observed)
    passes = sum(o.of("5").verify_ct for o in observed)
    assert (e.candidate_passes, e.candidate_tau) == (passes, emitted / passes)
    assert e.gain == pytest.approx(e.candidate_tau / e.champion_tau - 1)
    assert 0 < e.gain_low < e.gain < e.gain_high


def test_a_worse_canary_is_rolled_back_and_says_so_first():
    verdict = judge_canary(series([{"5": 1.7, "4": 2.0}] * 4), "5", "4", 10, POLICY)
    assert verdict.action == ROLL_BACK
    assert verdict.reason.startswith("canary v5 is worse than v4: τ ")
    assert verdict.evidence.gain_high < 0


def test_a_canary_no_better_than_the_champion_is_rolled_back_as_not_shown_better():
    verdict = judge_canary(series([{"5": 2.0, "4": 2.0}] * 4, seed=3), "5", "4", 10, POLICY)
    assert verdict.action == ROLL_BACK
    e = verdict.evidence
    assert e.gain_low < 0 < e.gain_high  # the interval straddles 0: no gain shown
    assert ("is not shown better than" in verdict.reason) == (e.gain >= 0)


def test_a_canary_waits_for_enough_steps_and_passes():
    two = series([{"5": 3.0, "4": 2.0}] * 2)
    verdict = judge_canary(two, "5", "4", 10, POLICY)
    assert verdict.action == WAIT and verdict.evidence is None
    assert "2 of 3 RL steps" in verdict.reason
    few = judge_canary(two, "5", "4", 10, CanaryPolicy(canary_steps=2,
                                                        min_verify_passes=10_000))
    assert few.action == WAIT and "of 10000 verify passes" in few.reason


def test_only_steps_since_the_start_where_both_drafted_count():
    observed = series([{"5": 1.5, "4": 2.0}, {"5": 1.5, "4": 2.0},  # before the start
                       {"5": 2.5, "4": 2.0}, {"4": 2.0},  # the canary's server was down
                       {"5": 2.5, "4": 2.0}, {"5": 2.5, "4": 2.0}])
    verdict = judge_canary(observed, "5", "4", started_at=12, policy=POLICY)
    assert verdict.action == PROMOTE and verdict.evidence.steps == (12, 14, 15)


def test_against_no_drafter_the_baseline_is_tau_one():
    verdict = judge_canary(series([{"5": 1.6, "none": 1.0}] * 3), "5", "none", 10, POLICY)
    assert verdict.action == PROMOTE and verdict.evidence.champion_tau == 1.0
    assert "beats no drafter" in verdict.reason
    with pytest.raises(ValueError, match="other than the champion"):
        judge_canary([], "4", "4", 0)


def test_a_canary_share_that_changes_between_steps_tilts_neither_side():
    """The canary serves 10 of 100 rollouts in an easy step and 50 of 100 in a step where
    the policy doubled τ; it is 5% better in both. Pooling each drafter's own rollouts
    would credit the canary with the hard step's τ (about +48%); the per-step τ averaged
    with the same weights for both gives the 5%."""
    rng = np.random.default_rng(2)
    observed = [
        summarise(10, rollouts("5", 2.1, 10, 10, rng) + rollouts("4", 2.0, 90, 10, rng)),
        summarise(11, rollouts("5", 4.2, 50, 10, rng) + rollouts("4", 4.0, 50, 10, rng))]
    e = judge_canary(observed, "5", "4", 10, CanaryPolicy(canary_steps=2,
                                                           min_verify_passes=100)).evidence
    assert e.gain == pytest.approx(0.05, abs=0.02) and e.gain_low < 0.05 < e.gain_high
    def pooled(v):
        return sum(o.of(v).emitted for o in observed) / sum(o.of(v).verify_ct for o in observed)

    assert pooled("5") / pooled("4") - 1 > 0.3  # what pooling each drafter's own would say


def test_a_step_with_too_few_rollouts_of_a_drafter_does_not_count():
    rng = np.random.default_rng(4)
    observed = series([{"5": 2.5, "4": 2.0}] * 3)
    observed.append(summarise(13, rollouts("5", 9.0, 1, 10, rng)
                              + rollouts("4", 2.0, 12, 10, rng)))
    verdict = judge_canary(observed, "5", "4", 10, POLICY)
    assert verdict.evidence.steps == (10, 11, 12)  # one rollout of v5 in step 13


def test_the_stratified_interval_is_the_plain_bootstrap_for_one_stratum():
    counts = [(23, 10), (19, 10), (31, 10), (25, 10), (18, 10)]
    low, high = stratified_gain_interval([counts], None, [1.0])
    ref_low, ref_high = tau_interval(counts)
    assert (low, high) == (ref_low - 1, ref_high - 1)  # the same draws, τ 1 as baseline
    assert all(math.isnan(x) for x in stratified_gain_interval([[]], None, [1.0]))


def test_pairing_by_step_leaves_the_policy_movement_out():
    """τ of both drafters doubles from one RL step to the next (the policy moved); the
    canary is 5% better in each. Resampling within steps keeps that movement out of the
    interval; pooling all rollouts and resampling them regardless of step does not."""
    observed = series([{"5": 2.1, "4": 2.0}, {"5": 4.2, "4": 4.0}] * 2, seed=1)
    paired = judge_canary(observed, "5", "4", 10, POLICY).evidence
    pooled_low, pooled_high = stratified_gain_interval(
        [[c for o in observed for c in o.of("5").per_rollout]],
        [[c for o in observed for c in o.of("4").per_rollout]], [1.0])
    assert paired.gain_low > 0
    assert paired.gain_high - paired.gain_low < (pooled_high - pooled_low) / 2
    with pytest.raises(ValueError, match="same strata"):
        stratified_gain_interval([[(1, 1)]], [], [1.0])


def test_aerie_canary_judges_from_the_stored_counters(tmp_path, monkeypatch, capsys):
    """``aerie canary`` reads the per-step summaries ``serving_acceptance`` stores and
    prints the verdict, its reason and the steps it counted."""
    import json

    from aerie import cli
    from pipeline.layout import observed_key
    from pipeline.records import to_json
    from pipeline.storage import Storage

    storage = Storage((tmp_path / "storage").as_uri())
    monkeypatch.setenv("AERIE_STORAGE_URL", storage.root_url)
    for observed in series([{"5": 1.5, "4": 2.0}] + [{"5": 2.5, "4": 2.0}] * 3):
        storage.write_bytes(observed_key(observed.step), to_json(observed).encode())
    assert cli.main(["canary", "5", "4", "--since", "11", "--steps", "3",
                     "--min-passes", "100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict:  promote\nwhy:      canary v5 beats v4: τ ")
    assert "RL step 10" not in out and out.count("  RL step ") == 3  # from the start on
    assert cli.main(["canary", "5", "4", "--since", "11", "--json"]) == 0  # 4 steps asked
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["action"] == "wait" and verdict["evidence"] is None
