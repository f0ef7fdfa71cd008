"""The acceptance gate as a decision table: every combination of its inputs."""

from __future__ import annotations

import ast
import copy
import inspect
import itertools
import math
import os

import pytest

from pipeline.records import from_json, to_json
from pipeline.release import gate
from pipeline.release.gate import Candidate, Decision, EvalSummary, GatePolicy, decide

POLICY = GatePolicy(min_relative_gain=0.05, min_cycles=100)
BASE_TAU = 2.0
# candidate τ relative to the baseline: clearly better, equal, worse, better within margin
COMPARISONS = {"better": 2.5, "equal": 2.0, "worse": 1.5, "within-margin": 2.05}


def summary(tau: float, *, cycles: int = 500, heldout: str = "H", settings: str = "S",
            version: str | None = None) -> EvalSummary:
    emitted = int(tau * cycles) if math.isfinite(tau) else 0
    return EvalSummary(tau=tau, cycles=cycles, emitted_tokens=emitted, alpha=(0.7, 0.5),
                       settings_key=settings, heldout_key=heldout, drafter_version=version)


TABLE = list(itertools.product(
    ["format-ok", "format-bad"], ["champion", "no-champion"], ["same-heldout", "other-heldout"],
    ["same-settings", "other-settings"], list(COMPARISONS), ["enough-cycles", "few-cycles"],
    ["finite-tau", "nan-tau"]))


@pytest.mark.parametrize("fmt,champ,heldout,settings,comparison,cycles,tau", TABLE,
                         ids=["/".join(row) for row in TABLE])
def test_decision_table(fmt, champ, heldout, settings, comparison, cycles, tau):
    cand_tau = math.nan if tau == "nan-tau" else COMPARISONS[comparison]
    # with no champion the baseline is the measured no-drafter run (τ 2 here, to share the
    # comparisons); it has no speculative settings, so only its held-out key matters
    baseline = summary(BASE_TAU, heldout="H" if heldout == "same-heldout" else "H2",
                       settings="S" if settings == "same-settings" else "S2", version="7")
    candidate = Candidate(
        summary(cand_tau, cycles=500 if cycles == "enough-cycles" else 20),
        format_ok=fmt == "format-ok",
        format_errors=() if fmt == "format-ok" else ("lm_head.weight: shape (3, 4)",))
    if champ == "champion":
        decision = decide(candidate, baseline, None, POLICY)
    else:
        decision = decide(candidate, None, baseline, POLICY)

    expected_failures = {
        "format": fmt == "format-bad",
        "measurement": cycles == "few-cycles" or tau == "nan-tau",
        "heldout": heldout == "other-heldout",
        "settings": settings == "other-settings" and champ == "champion",
        "gain": tau == "nan-tau" or comparison != "better",
    }
    assert decision.promote == (not any(expected_failures.values()))
    assert decision.reasons, "a decision always explains itself"
    checks = {r.split(":", 1)[0] for r in decision.reasons}
    if decision.promote:
        assert "gain" in checks and "format" in checks
        assert decision.relative_gain == pytest.approx(0.25)
    else:
        assert checks == {k for k, failed in expected_failures.items() if failed}
    assert decision.baseline == ("champion" if champ == "champion" else "no-drafter")
    assert decision.champion_version == ("7" if champ == "champion" else None)


@pytest.mark.parametrize("cand_tau,champ_tau,margin,promote,words", [
    (3.0, 2.0, 0.0, True, "beats"),
    (2.0, 2.0, 0.0, False, "equals"),  # margin 0 still needs a strict gain
    (2.5, 2.0, 0.25, True, "beats"),  # exactly the margin passes
    (2.49, 2.0, 0.25, False, "less than the margin"),
    (1.9, 2.0, 0.0, False, "worse"),
])
def test_margin_edges(cand_tau, champ_tau, margin, promote, words):
    d = decide(Candidate(summary(cand_tau), True), summary(champ_tau),
               policy=GatePolicy(min_relative_gain=margin, min_cycles=1))
    assert d.promote is promote
    assert any(words in r for r in d.reasons)


def test_no_champion_defaults_to_tau_one():
    policy = GatePolicy(min_relative_gain=0.1, min_cycles=1)
    assert decide(Candidate(summary(1.2), True), None, None, policy).promote
    refused = decide(Candidate(summary(1.05), True), None, None, policy)
    assert not refused.promote and refused.baseline_tau == 1.0
    assert "no drafter" in refused.reasons[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.5])
def test_invalid_champion_or_baseline_measurement_refuses(bad):
    policy = GatePolicy(min_relative_gain=0.0, min_cycles=1)
    d = decide(Candidate(summary(3.0), True), summary(bad), policy=policy)
    assert not d.promote and any(r.startswith("measurement: champion") for r in d.reasons)
    d = decide(Candidate(summary(3.0), True), None, summary(bad), policy)
    assert not d.promote


def test_champion_with_too_few_cycles_refuses():
    d = decide(Candidate(summary(3.0), True), summary(2.0, cycles=5, version="4"),
               policy=POLICY)
    assert not d.promote
    assert any("champion v4 was measured over 5 cycles" in r for r in d.reasons)


def test_refusal_lists_every_failed_check_and_format_errors():
    d = decide(Candidate(summary(math.nan, cycles=3, heldout="X"), False,
                         ("missing tensors ['d2t']",)),
               summary(2.0), policy=POLICY)
    text = " | ".join(d.reasons)
    assert "missing tensors ['d2t']" in text and "3 cycles" in text and "X vs H" in text
    assert not d.promote and math.isnan(d.relative_gain)


def test_decide_is_pure(monkeypatch):
    """Same inputs, same decision; inputs untouched; no file, network, clock, randomness or
    environment read (each is made to fail); and the module imports nothing that could."""
    cand, champ = Candidate(summary(2.5), True), summary(2.0)
    before = copy.deepcopy((cand, champ, POLICY))
    first = decide(cand, champ, None, POLICY)

    def forbidden(*_a, **_k):
        raise AssertionError("decide reached outside its arguments")

    for target in ("builtins.open", "time.time", "time.monotonic", "random.random",
                   "os.getenv", "socket.socket"):
        monkeypatch.setattr(target, forbidden)
    monkeypatch.setattr(os, "environ", {})
    again = decide(cand, champ, None, POLICY)
    monkeypatch.undo()
    assert again == first and first.promote
    assert (cand, champ, POLICY) == before
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(ast.parse(inspect.getsource(gate)))
                if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    # the gain's interval: a bootstrap with its own fixed seed (numpy, no I/O)
    assert imported <= {"__future__", "math", "dataclasses", "collections.abc",
                        "pipeline.evaluation.confidence"}


def test_decision_json_round_trip():
    d = decide(Candidate(summary(math.nan), True), summary(2.0), policy=POLICY)
    back = from_json(Decision, to_json(d))
    assert back.reasons == d.reasons and math.isnan(back.relative_gain)
    assert back.policy == POLICY


def test_inputs_are_validated():
    with pytest.raises(ValueError):
        Candidate(summary(2.0), format_ok=True, format_errors=("x",))
    with pytest.raises(ValueError):
        GatePolicy(min_relative_gain=-0.1)
    with pytest.raises(ValueError):
        GatePolicy(min_cycles=0)
    with pytest.raises(ValueError):
        EvalSummary(tau=2.0, cycles=-1, emitted_tokens=0, alpha=(), settings_key="s",
                    heldout_key="h")


def test_a_candidate_that_is_the_champion_is_not_compared_with_itself():
    """A re-run after the candidate's promotion measures it against itself: τ equals τ, which
    is no reason to refuse the champion."""
    d = decide(Candidate(summary(2.0, version="4"), True), summary(2.0, version="4"),
               policy=POLICY)
    assert (d.verdict, d.promote, d.champion_version) == ("already_champion", False, "4")
    assert d.reasons == ("champion: the candidate is champion v4 itself; there is nothing "
                         "to promote or refuse",)
    assert from_json(Decision, to_json(d)) == d
    other = decide(Candidate(summary(2.0, version="5"), True), summary(2.0, version="4"),
                   policy=POLICY)
    assert other.verdict == "refuse" and any("equals" in r for r in other.reasons)
    unknown = decide(Candidate(summary(2.0), True), summary(2.0), policy=POLICY)
    assert unknown.verdict == "refuse"  # versions unknown: nothing says they are the same


def test_verdict_and_promote_agree():
    fields = dict(reasons=("x",), baseline="champion", candidate_tau=2.0, baseline_tau=2.0,
                  relative_gain=0.0)
    assert Decision(promote=True, **fields).verdict == "promote"
    assert Decision(promote=False, **fields).verdict == "refuse"
    with pytest.raises(ValueError, match="contradicts"):
        Decision(promote=True, verdict="already_champion", **fields)
    with pytest.raises(ValueError, match="verdict"):
        Decision(promote=False, verdict="maybe", **fields)


def counted(taus: list[float], cycles: int = 20, **kwargs) -> EvalSummary:
    """A summary with per-prompt counts: prompt i emitted ``taus[i] · cycles`` tokens."""
    per_prompt = [(round(t * cycles), cycles) for t in taus]
    emitted, total = sum(e for e, _ in per_prompt), cycles * len(taus)
    return EvalSummary(tau=emitted / total, cycles=total, emitted_tokens=emitted, alpha=(0.5,),
                       settings_key="S", heldout_key="H", per_prompt=per_prompt, **kwargs)


def test_a_gain_inside_the_noise_is_refused_and_a_steady_one_promoted():
    policy = GatePolicy(min_relative_gain=0.01, min_cycles=10)
    champion = counted([2.0, 3.0, 1.5, 2.5, 2.0, 3.5, 1.5, 2.0], drafter_version="3")
    # +5% on average, but half the prompts got worse: the interval reaches below 0
    noisy = counted([2.6, 2.6, 1.2, 3.0, 1.7, 4.0, 1.3, 2.3])
    decision = decide(Candidate(noisy, True), champion, None, policy)
    assert decision.relative_gain > policy.min_relative_gain and not decision.promote
    assert [r.split(":")[0] for r in decision.reasons] == ["confidence"]
    lo, hi = decision.gain_interval
    assert lo < 0 < hi and "may be noise" in decision.reasons[0]
    # the same +5%, on every prompt
    steady = counted([2.1, 3.15, 1.575, 2.625, 2.1, 3.675, 1.575, 2.1])
    decision = decide(Candidate(steady, True), champion, None, policy)
    assert decision.promote and decision.gain_interval[0] > 0
    assert any(r.startswith("confidence: the 95% interval") for r in decision.reasons)
    # no interval asked for: the margin alone decides
    unchecked = GatePolicy(min_relative_gain=0.01, min_cycles=10, confidence=None)
    assert decide(Candidate(noisy, True), champion, None, unchecked).promote


def test_the_deciding_reason_comes_first():
    policy = GatePolicy(min_relative_gain=0.01, min_cycles=10)
    champion = counted([2.0, 3.0, 1.5, 2.5, 2.0, 3.5, 1.5, 2.0], drafter_version="3")
    worse = counted([1.0, 1.4, 0.75, 1.2, 1.0, 1.7, 0.7, 1.0])  # about half the champion's τ
    decision = decide(Candidate(worse, True), champion, None, policy)
    assert [r.split(":")[0] for r in decision.reasons] == ["gain", "confidence"]
    assert "is worse than champion v3" in decision.reasons[0]
    assert "not better" in decision.reasons[1] and "noise" not in decision.reasons[1]
    better = counted([2.4, 3.6, 1.8, 3.0, 2.4, 4.2, 1.8, 2.4])
    promoted = decide(Candidate(better, True), champion, None, policy)
    assert promoted.promote
    assert [r.split(":")[0] for r in promoted.reasons] == [
        "gain", "confidence", "heldout", "format"]
    unreadable = decide(Candidate(worse, False, ("no config.json",)), champion, None, policy)
    assert unreadable.reasons[0].startswith("format: candidate failed")


def test_reports_of_other_samplers_are_not_compared():
    policy = GatePolicy(min_relative_gain=0.01, min_cycles=10)
    champion = counted([2.0] * 8, sampler_key="T=1", drafter_version="3")
    candidate = counted([3.0] * 8, sampler_key="greedy")
    decision = decide(Candidate(candidate, True), champion, None, policy)
    assert not decision.promote and [r.split(":")[0] for r in decision.reasons] == ["sampler"]
    no_drafter = counted([1.0] * 8, sampler_key="T=1")
    decision = decide(Candidate(candidate, True), None, no_drafter, policy)
    assert not decision.promote and "sampler" in decision.reasons[0]
