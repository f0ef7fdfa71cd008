"""The acceptance gate: should a candidate drafter replace the champion? A pure function.

:func:`decide` compares a candidate's measured acceptance length τ (tokens emitted per
draft-verify cycle) with the champion's, or with serving no drafter at all (τ = 1 by
definition: every verify cycle emits exactly one token) when there is no champion.

Invariants:

- Pure: the decision depends only on its arguments (no clock, no I/O, no randomness).
- Promote iff ALL hold: the candidate passed format validation; every τ involved is a finite
  number ≥ 1 measured over at least ``policy.min_cycles`` cycles; the candidate and the
  champion were measured on the SAME held-out prompt set, with the SAME speculative
  settings and the SAME sampler (``heldout_key``, ``settings_key``, ``sampler_key``; the
  no-drafter baseline has no speculative settings, so its held-out and sampler keys are
  compared); the candidate's τ beats the baseline's by at least
  ``policy.min_relative_gain`` (relative) and strictly; and, where both carry per-prompt
  counts, the lower end of the ``policy.confidence`` bootstrap interval of that gain
  (prompts resampled jointly, :mod:`pipeline.evaluation.confidence`) is above 0: a gain
  the noise of sampled τ could explain is not a gain.
- A candidate that IS the champion (same registry version) is not compared with itself:
  the verdict is ``already_champion``, nothing to promote and nothing to refuse.
- Reasons always explain: a refusal lists every failed check (not only the first); a
  promotion states the gain and what was compared. Each reason starts with the name of its
  check (``format:``, ``measurement:``, ``heldout:``, ``settings:``, ``gain:``;
  ``sampler:``, ``confidence:``; ``champion:`` for ``already_champion``). The deciding
  reason comes first (:data:`REFUSAL_ORDER`, :data:`PROMOTION_ORDER`): a worse candidate is
  refused first for being worse, not for the width of an interval; a promotion leads with
  its gain. Screens that show one reason show the first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.evaluation.confidence import RESAMPLES, gain_interval

GATE_SCHEMA_VERSION = 1
DECISION_SCHEMA_VERSION = 2  # 2: verdict
NO_DRAFTER_TAU = 1.0

PROMOTE = "promote"
REFUSE = "refuse"
ALREADY_CHAMPION = "already_champion"
VERDICTS = (PROMOTE, REFUSE, ALREADY_CHAMPION)
# the order reasons are given in, by their check: what decides first
REFUSAL_ORDER = ("format", "measurement", "heldout", "settings", "sampler", "gain",
                 "confidence")
PROMOTION_ORDER = ("gain", "confidence", "heldout", "format")


@dataclass(frozen=True)
class EvalSummary:
    """What the gate needs from one drafter's evaluation (or from the no-drafter baseline).

    ``settings_key`` hashes the speculative settings (num_steps, topk, num_draft_tokens,
    max_new_tokens); ``heldout_key`` hashes the held-out prompt set; ``sampler_key`` the
    sampler (temperature, top_p, top_k, min_p). ``drafter_version`` is the registry version
    that was measured (None for the no-drafter baseline or unknown). ``per_prompt``:
    (emitted_tokens, cycles) per held-out prompt, in prompt order (empty: unknown).
    """

    tau: float
    cycles: int
    emitted_tokens: int
    alpha: tuple[float, ...]
    settings_key: str
    heldout_key: str
    drafter_version: str | None = None
    sampler_key: str = ""
    per_prompt: tuple[tuple[int, int], ...] = ()
    schema_version: int = GATE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.cycles < 0 or self.emitted_tokens < 0:
            raise ValueError("cycles and emitted_tokens must be >= 0")
        object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))
        object.__setattr__(self, "per_prompt", tuple(
            (int(e), int(c)) for e, c in self.per_prompt))


@dataclass(frozen=True)
class Candidate:
    """The candidate's evaluation plus the result of its format validation."""

    summary: EvalSummary
    format_ok: bool
    format_errors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "format_errors", tuple(self.format_errors))
        if self.format_ok and self.format_errors:
            raise ValueError("format_ok is True but format_errors are given")


@dataclass(frozen=True)
class GatePolicy:
    """How much better a candidate must be, and how much evidence a τ needs."""

    min_relative_gain: float = 0.01  # candidate τ >= baseline τ · (1 + gain), and > baseline
    min_cycles: int = 200  # fewer draft-verify cycles is noise, not a measurement
    confidence: float | None = 0.95  # the gain's interval must clear 0; None: not checked

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_relative_gain) and self.min_relative_gain >= 0):
            raise ValueError("min_relative_gain must be a finite number >= 0")
        if self.min_cycles < 1:
            raise ValueError("min_cycles must be >= 1")
        if self.confidence is not None and not 0 < self.confidence < 1:
            raise ValueError("confidence must be in (0, 1), or None")


@dataclass(frozen=True)
class Decision:
    """The gate's verdict. ``baseline`` is ``"champion"`` or ``"no-drafter"``.

    ``verdict`` is one of :data:`VERDICTS`; ``promote`` is ``verdict == "promote"`` (kept
    as a field for readers of the JSON). ``verdict`` defaults from ``promote``.
    """

    promote: bool
    reasons: tuple[str, ...]
    baseline: str
    candidate_tau: float
    baseline_tau: float
    relative_gain: float  # candidate τ / baseline τ - 1 (NaN when not comparable)
    champion_version: str | None = None  # the champion the candidate was measured against
    gain_interval: tuple[float, ...] = ()  # (lo, hi) at policy.confidence; () if unchecked
    policy: GatePolicy = field(default_factory=GatePolicy)
    verdict: str = ""
    schema_version: int = DECISION_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.verdict:
            object.__setattr__(self, "verdict", PROMOTE if self.promote else REFUSE)
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")
        if self.promote != (self.verdict == PROMOTE):
            raise ValueError(f"promote={self.promote} contradicts verdict {self.verdict!r}")


def decide(candidate: Candidate, champion: EvalSummary | None,
           no_drafter: EvalSummary | None = None, policy: GatePolicy | None = None
           ) -> Decision:
    """The promotion decision for ``candidate`` (see the module docstring for the rules).

    ``no_drafter`` is the measured no-drafter baseline on the same held-out set; when None,
    τ = 1 (its definition) is used. It is only consulted when there is no champion.
    """
    policy = policy or GatePolicy()
    cand = candidate.summary
    if champion is not None and champion.drafter_version is not None \
            and champion.drafter_version == cand.drafter_version:
        return _already_champion(cand, champion, policy)
    failed: list[str] = []
    passed: list[str] = []

    if candidate.format_ok:
        passed.append("format: candidate passed format validation")
    else:
        detail = "; ".join(candidate.format_errors) or "no details given"
        failed.append(f"format: candidate failed format validation ({detail})")

    failed += _measurement_problems("candidate", cand, policy)

    if champion is not None:
        name = f"champion v{champion.drafter_version}" if champion.drafter_version \
            else "champion"
        baseline, base_tau = "champion", champion.tau
        failed += _measurement_problems(name, champion, policy)
        failed += _key_problems(cand, champion, name, ("heldout", "settings", "sampler"))
        passed.append(f"heldout: same held-out set {cand.heldout_key}, settings "
                      f"{cand.settings_key} and sampler {cand.sampler_key or '-'} as {name}")
    else:
        name, baseline = "no drafter", "no-drafter"
        base_tau = NO_DRAFTER_TAU
        if no_drafter is not None:
            base_tau = no_drafter.tau
            failed += _measurement_problems("no-drafter baseline", no_drafter, policy)
            failed += _key_problems(cand, no_drafter, "the no-drafter baseline",
                                    ("heldout", "sampler"))
        passed.append(f"heldout: no champion; compared with {name} (τ = {base_tau:.4g}) on "
                      f"held-out set {cand.heldout_key}")

    interval = _confidence(cand, champion if champion is not None else no_drafter, name,
                           policy, passed, failed)
    gain = cand.tau / base_tau - 1.0 if _finite(cand.tau) and _finite(base_tau) \
        and base_tau > 0 else math.nan
    need = policy.min_relative_gain
    if not _finite(gain):
        failed.append(f"gain: cannot compare candidate τ {cand.tau} with {name} τ {base_tau}")
    elif gain > 0 and cand.tau >= base_tau * (1.0 + need):
        passed.append(f"gain: candidate τ {cand.tau:.4f} beats {name} τ {base_tau:.4f} by "
                      f"{gain:+.2%} (at least {need:.2%} required)")
    else:
        verdict = "is worse than" if gain < 0 else "equals" if gain == 0 else \
            "beats, but by less than the margin,"
        failed.append(f"gain: candidate τ {cand.tau:.4f} {verdict} {name} τ {base_tau:.4f} "
                      f"({gain:+.2%}; at least {need:.2%} required)")

    reasons = _ordered(failed, REFUSAL_ORDER) if failed else _ordered(passed, PROMOTION_ORDER)
    return Decision(promote=not failed, reasons=reasons, baseline=baseline,
                    candidate_tau=float(cand.tau), baseline_tau=float(base_tau),
                    relative_gain=float(gain),
                    champion_version=champion.drafter_version if champion else None,
                    policy=policy, gain_interval=interval)


def _ordered(reasons: Sequence[str], order: Sequence[str]) -> tuple[str, ...]:
    """``reasons`` by the rank of their check in ``order`` (ties keep their order)."""
    def rank(reason: str) -> int:
        check = reason.split(":", 1)[0]
        return order.index(check) if check in order else len(order)
    return tuple(sorted(reasons, key=rank))


_KEYS = {"heldout": ("heldout_key", "held-out sets"),
         "settings": ("settings_key", "speculative settings"),
         "sampler": ("sampler_key", "samplers")}


def _key_problems(cand: EvalSummary, other: EvalSummary, name: str, checks: Sequence[str]
                  ) -> list[str]:
    problems = []
    for check in checks:
        key, what = _KEYS[check]
        ours, theirs = getattr(cand, key), getattr(other, key)
        if ours != theirs:
            problems.append(f"{check}: candidate and {name} were measured with different "
                            f"{what} ({ours or '-'} vs {theirs or '-'}); τ is not comparable")
    return problems


def _confidence(cand: EvalSummary, base: EvalSummary | None, name: str, policy: GatePolicy,
                passed: list[str], failed: list[str]) -> tuple[float, ...]:
    """The gain's bootstrap interval must lie above 0 (module docstring)."""
    if policy.confidence is None:
        return ()
    if base is None or not cand.per_prompt or not base.per_prompt:
        passed.append(f"confidence: no per-prompt counts for candidate and {name} (a "
                      "report from before intervals); the gain's interval is not checked")
        return ()
    if len(cand.per_prompt) != len(base.per_prompt):
        failed.append(f"confidence: candidate and {name} have counts of "
                      f"{len(cand.per_prompt)} and {len(base.per_prompt)} prompts; they "
                      "cannot be paired")
        return ()
    lo, hi = gain_interval(cand.per_prompt, base.per_prompt, policy.confidence, RESAMPLES)
    level, prompts = f"{policy.confidence:.0%}", len(cand.per_prompt)
    if not (_finite(lo) and _finite(hi)):
        failed.append(f"confidence: no interval of the gain over {name} ({prompts} prompts)")
    elif lo > 0:
        passed.append(f"confidence: the {level} interval of the gain over {name}, "
                      f"[{lo:+.2%}, {hi:+.2%}] over {prompts} prompts, lies above 0")
    elif hi <= 0:
        failed.append(f"confidence: the {level} interval of the gain over {name}, "
                      f"[{lo:+.2%}, {hi:+.2%}] over {prompts} prompts, lies at or below 0: "
                      "the candidate is not better")
    else:
        failed.append(f"confidence: the {level} interval of the gain over {name}, "
                      f"[{lo:+.2%}, {hi:+.2%}] over {prompts} prompts, reaches 0 or below: "
                      "the gain may be noise (more prompts narrow it)")
    return (lo, hi)


def _already_champion(cand: EvalSummary, champion: EvalSummary, policy: GatePolicy
                      ) -> Decision:
    """The candidate is the champion's registry version: a re-run after its promotion (or
    an evaluation of the served drafter); comparing it with itself would be meaningless."""
    gain = cand.tau / champion.tau - 1.0 if _finite(cand.tau) and _finite(champion.tau) \
        and champion.tau > 0 else math.nan
    return Decision(promote=False, verdict=ALREADY_CHAMPION,
                    reasons=(f"champion: the candidate is champion v{champion.drafter_version} "
                             f"itself; there is nothing to promote or refuse",),
                    baseline="champion", candidate_tau=float(cand.tau),
                    baseline_tau=float(champion.tau), relative_gain=float(gain),
                    champion_version=champion.drafter_version, policy=policy)


def _measurement_problems(name: str, s: EvalSummary, policy: GatePolicy) -> list[str]:
    problems = []
    if not _finite(s.tau):
        problems.append(f"measurement: {name} τ is not a finite number ({s.tau})")
    elif s.tau < 1.0:
        problems.append(f"measurement: {name} τ {s.tau} is below 1, impossible for tokens "
                        f"per verify cycle")
    if s.cycles < policy.min_cycles:
        problems.append(f"measurement: {name} was measured over {s.cycles} cycles, fewer than "
                        f"the {policy.min_cycles} required")
    return problems


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
