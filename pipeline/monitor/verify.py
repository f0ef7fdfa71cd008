"""Did the promotion take? Acceptance after the serving update, against the gate's τ.

The gate promotes on a τ measured offline; what the servers do after the update is another
matter (a restart that kept the old drafter, a drafter loaded with the wrong ``d2t``, a server
that came back without speculation). :func:`judge` compares an observed τ with a floor,
``max(min(min_tau, gated τ), min_share * gated τ)``, taking the noise into account: the promotion is
``broken`` only when the upper end of the observed τ's bootstrap interval lies below the
floor, ``undecided`` while fewer than ``min_cycles`` verify passes or ``min_samples`` prompts (or
rollouts) were seen.

Two sources of the observed τ:

- ``live`` (:func:`verify_live`, the SGLang serving modes): the refresh's own held-out prompts
  (the probe set the gate measured on), decoded by the live servers at the gate's sampler,
  seed and ``max_new_tokens`` (:func:`~pipeline.evaluation.sglang_mode.measure_server_acceptance`).
  A server that does not speculate is a broken promotion; one that cannot be reached gives
  no verdict (an error: the asset is retried).
- ``reported`` (:func:`verify_reported`, where Aerie cannot reach the servers): the counters
  the RL engine reported with the drafter in the RL steps since (:mod:`.observed`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.monitor.observed import StepAcceptance
from pipeline.sampling import SamplingParams
from pipeline.storage import Storage

HEALTHY, BROKEN, UNDECIDED = "healthy", "broken", "undecided"


@dataclass(frozen=True)
class VerifyPolicy:
    min_tau: float = 1.1  # absolute floor: below it the drafter barely drafts
    min_share: float = 0.8  # relative floor: this share of the gate's τ
    min_cycles: int = 20  # verify passes before a verdict
    min_samples: int = 5  # prompts (or rollouts) before a verdict: the interval needs them
    level: float = 0.95  # of the interval the verdict allows for

    def __post_init__(self) -> None:
        if self.min_tau < 1 or not 0 <= self.min_share <= 1 or self.min_cycles < 1 \
                or self.min_samples < 1 or not 0 < self.level < 1:
            raise ValueError("verify policy: need min_tau >= 1, 0 <= min_share <= 1, "
                             "min_cycles >= 1, min_samples >= 1 and 0 < level < 1")

    def floor(self, gated_tau: float) -> float:
        """max(min_tau, min_share × the gated τ), the absolute part never above the gated τ
        itself (a drafter the gate promoted at τ 1.08 is held to 1.08, not to 1.1)."""
        return max(min(self.min_tau, gated_tau), self.min_share * gated_tau)


@dataclass(frozen=True)
class Verification:
    """The verdict on one promoted version (``verdict``: healthy | broken | undecided)."""

    version: str
    source: str  # live | reported
    verdict: str
    reason: str
    gated_tau: float
    floor: float
    tau: float | None = None
    tau_low: float | None = None
    tau_high: float | None = None
    cycles: int = 0

    @property
    def broken(self) -> bool:
        return self.verdict == BROKEN

    def metadata(self) -> dict:
        return {"verdict": self.verdict, "source": self.source, "version": self.version,
                "gated_tau": round(self.gated_tau, 4), "floor": round(self.floor, 4),
                "observed_tau": _rounded(self.tau), "observed_tau_low": _rounded(self.tau_low),
                "observed_tau_high": _rounded(self.tau_high), "verify_passes": self.cycles}


def judge(version: str, source: str, gated_tau: float, counts: Sequence[Sequence[int]],
          policy: VerifyPolicy, *, failure: str | None = None) -> Verification:
    """The verdict on per-prompt (or per-rollout) ``(emitted, verify passes)`` counts;
    ``failure``: why nothing could be measured (broken)."""
    from pipeline.evaluation.confidence import tau_interval

    floor = policy.floor(gated_tau)
    base = dict(version=version, source=source, gated_tau=gated_tau, floor=floor)
    if failure is not None:
        return Verification(**base, verdict=BROKEN, reason=failure)
    emitted, cycles = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if cycles < policy.min_cycles or len(counts) < policy.min_samples:
        return Verification(**base, verdict=UNDECIDED, cycles=cycles, tau=_ratio(emitted, cycles),
                            reason=f"{cycles} verify passes over {len(counts)} samples "
                                   f"observed, {policy.min_cycles} and {policy.min_samples} "
                                   f"needed")
    tau = emitted / cycles
    low, high = tau_interval(counts, level=policy.level)
    seen = (f"observed τ {tau:.3f} [{low:.3f}, {high:.3f}] over {cycles} verify passes "
            f"({source}); floor {floor:.3f} = max({policy.min_tau} (at most the gated τ), "
            f"{policy.min_share:.0%} of the gated τ {gated_tau:.3f})")
    verdict = BROKEN if high < floor else HEALTHY
    return Verification(**base, verdict=verdict, tau=tau, tau_low=low, tau_high=high,
                        cycles=cycles, reason=("below the floor: " if verdict == BROKEN
                                               else "") + seen)


def verify_live(storage: Storage, step: int, version: str, urls: Sequence[str],
                policy: VerifyPolicy, *, api_key: str | None = None, timeout_s: float = 600.0
                ) -> Verification:
    """Probe the servers at ``urls`` with the refresh of ``step``'s held-out prompts, at the
    gate's sampler and settings, and judge ``version`` against the τ the gate measured."""
    from pipeline.capture.heldout import heldout_prompts
    from pipeline.release.register import read_refresh_report

    report = read_refresh_report(storage, step)
    _, prompts = heldout_prompts(storage, report.heldout["window_steps"],
                                 report.heldout["prompts"])
    counts, failure = probe(urls, [list(p.prompt_ids) for p in prompts],
                            report.settings["max_new_tokens"], report.sampling, report.seed,
                            api_key=api_key, timeout_s=timeout_s)
    return judge(version, "live", report.contestants["candidate"].tau, counts, policy,
                 failure=failure)


def probe(urls: Sequence[str], prompts: Sequence[Sequence[int]], max_new_tokens: int,
          sampler: SamplingParams, seed: int, *, api_key: str | None = None,
          timeout_s: float = 600.0) -> tuple[tuple[tuple[int, int], ...], str | None]:
    """Per-prompt ``(emitted, verify passes)`` of the live servers, or why there are none: a
    server that does not decode with an EAGLE-3 drafter is a failure (the promotion did not
    take). One that cannot be reached raises (``EngineRequestError``): that is no verdict,
    and the caller tries again. The servers' caches are left alone (no ``/flush_cache``:
    rollout servers are busy)."""
    from pipeline.evaluation.sglang_mode import SpeculativeConfigError, measure_server_acceptance

    try:
        measured = measure_server_acceptance(list(urls), prompts, max_new_tokens,
                                             sampler=sampler, seed=seed, api_key=api_key,
                                             timeout=timeout_s, flush=False)
    except SpeculativeConfigError as e:  # not speculating, or not with these settings
        return (), f"the servers do not speculate as served: {e}"
    return measured.per_prompt, None


def verify_reported(series: Sequence[StepAcceptance], version: str, gated_tau: float,
                    policy: VerifyPolicy) -> Verification:
    """Judge ``version`` on every rollout the RL engine reported it drafted in ``series``."""
    counts = [c for o in series if (v := o.of(version)) is not None for c in v.per_rollout]
    return judge(version, "reported", gated_tau, counts, policy)


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def _rounded(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)
