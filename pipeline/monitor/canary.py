"""Judging a canary: a candidate serving part of the rollouts, next to the champion.

A candidate that passed the offline gate may serve a share of the rollout servers first,
while the champion serves the rest. Speculative decoding is lossless, so a worse canary costs
rollout speed, never correctness. The RL engine's counters carry the drafter version that
served each rollout (:mod:`.observed`), so each RL step gives both drafters' τ on the same
prompt distribution and the same policy.

:func:`judge_canary` decides from the RL steps since the canary started:

- ``wait`` while fewer than ``canary_steps`` of those steps had both drafters drafting (at
  least ``min_rollouts`` rollouts each), or either drafter made fewer than
  ``min_verify_passes`` verify passes over them;
- ``promote`` when the lower end of the interval of the candidate's relative gain is above
  ``min_relative_gain``;
- ``roll_back`` otherwise: the canary did not show that it is better.

The comparison pairs the two drafters by RL step: each one's τ is taken per step, and the
steps are averaged with the same weights for both (the step's verify passes, both drafters'
together), so a step where the canary served a larger or smaller share of the rollouts tilts
neither side. The interval resamples each drafter's rollouts within each step
(:func:`~pipeline.evaluation.confidence.stratified_gain_interval`); the step-to-step
movement of the policy is shared by both and leaves the comparison. It treats the rollouts
of a step as independent: rollouts of one prompt group served together by one server make
it narrower than it should be. A champion of ``none`` (no drafter) has τ 1 by definition.

Pure: the verdict depends only on its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.evaluation.confidence import stratified_gain_interval
from pipeline.monitor.observed import StepAcceptance, VersionAcceptance

WAIT, PROMOTE, ROLL_BACK = "wait", "promote", "roll_back"
NO_DRAFTER = "none"


@dataclass(frozen=True)
class CanaryPolicy:
    canary_steps: int = 4  # RL steps with both drafters drafting before a verdict
    min_verify_passes: int = 200  # per drafter over those steps
    min_rollouts: int = 2  # per drafter in a step for the step to count
    min_relative_gain: float = 0.0  # the gain interval's lower end must be above it
    level: float = 0.95

    def __post_init__(self) -> None:
        if self.canary_steps < 1 or self.min_verify_passes < 1 or self.min_rollouts < 1 \
                or not 0 < self.level < 1 or not math.isfinite(self.min_relative_gain):
            raise ValueError("canary policy: need canary_steps, min_verify_passes and "
                             "min_rollouts >= 1, a finite min_relative_gain and 0 < level < 1")


@dataclass(frozen=True)
class CanaryEvidence:
    """What the verdict was decided on."""

    steps: tuple[int, ...]  # RL steps where both drafters drafted
    candidate_tau: float  # per-step τ averaged with the steps' weights
    champion_tau: float  # the same average; 1.0 for no drafter
    candidate_passes: int
    champion_passes: int
    gain: float  # candidate_tau / champion_tau - 1
    gain_low: float  # the ``level`` interval of the gain
    gain_high: float


@dataclass(frozen=True)
class CanaryVerdict:
    action: str  # wait | promote | roll_back
    candidate: str
    champion: str
    reason: str  # one sentence, the deciding fact first
    evidence: CanaryEvidence | None = None


def judge_canary(series: Sequence[StepAcceptance], candidate: str, champion: str,
                 started_at: int, policy: CanaryPolicy = CanaryPolicy()) -> CanaryVerdict:
    """The verdict on canary ``candidate`` against ``champion`` (registry versions, or
    ``none`` for a champion of no drafter) from the observed RL steps ``series``; only
    steps from ``started_at`` (the first RL step the canary served) on count."""
    if candidate in (champion, NO_DRAFTER):
        raise ValueError(f"a canary needs a candidate drafter other than the champion "
                         f"(candidate {candidate!r}, champion {champion!r})")
    paired = []
    for observed in sorted(series, key=lambda o: o.step):
        if observed.step < started_at:
            continue
        mine = observed.of(candidate)
        theirs = observed.of(champion) if champion != NO_DRAFTER else None
        if not _drafted(mine, policy) or (champion != NO_DRAFTER
                                          and not _drafted(theirs, policy)):
            continue
        paired.append((observed.step, mine, theirs))
    steps = tuple(step for step, _, _ in paired)
    passes = sum(m.verify_ct for _, m, _ in paired)
    baseline_passes = (sum(t.verify_ct for _, _, t in paired) if champion != NO_DRAFTER
                       else passes)
    name, other = _name(candidate), _name(champion)
    if len(steps) < policy.canary_steps or min(passes, baseline_passes) < \
            policy.min_verify_passes:
        both = f"both {name} and {other}" if champion != NO_DRAFTER else name
        return CanaryVerdict(WAIT, candidate, champion, (
            f"canary {name}: {len(steps)} of {policy.canary_steps} RL steps with {both} "
            f"drafting, {min(passes, baseline_passes)} of {policy.min_verify_passes} verify "
            f"passes: not judged yet"))
    weights = [m.verify_ct + (t.verify_ct if t is not None else 0) for _, m, t in paired]
    total = sum(weights)
    tau = sum(w * m.tau for w, (_, m, _) in zip(weights, paired, strict=True)) / total
    base = (sum(w * t.tau for w, (_, _, t) in zip(weights, paired, strict=True)) / total
            if champion != NO_DRAFTER else 1.0)
    low, high = stratified_gain_interval(
        [m.per_rollout for _, m, _ in paired],
        [t.per_rollout for _, _, t in paired] if champion != NO_DRAFTER else None,
        weights, policy.level)
    evidence = CanaryEvidence(steps, tau, base, passes, baseline_passes, tau / base - 1,
                              low, high)
    where = (f"τ {tau:.3f} vs {other} {base:.3f} on RL steps {steps[0]}–{steps[-1]} "
             f"({evidence.gain:+.1%}, {policy.level:.0%} interval {low:+.1%} … {high:+.1%})")
    if math.isfinite(low) and low > policy.min_relative_gain:
        return CanaryVerdict(PROMOTE, candidate, champion,
                             f"canary {name} beats {other}: {where}", evidence)
    why = ("is worse than" if evidence.gain < 0 else
           "is not shown better than")
    return CanaryVerdict(ROLL_BACK, candidate, champion,
                         f"canary {name} {why} {other}: {where}", evidence)


def _drafted(version: VersionAcceptance | None, policy: CanaryPolicy) -> bool:
    """Whether a drafter's rollouts in one step count: enough of them, and verify passes."""
    return version is not None and version.verify_ct > 0 \
        and version.rollouts >= policy.min_rollouts


def _name(version: str) -> str:
    return "no drafter" if version == NO_DRAFTER else f"v{version}"
