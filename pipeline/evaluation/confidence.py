"""How sure a τ is: percentile bootstrap over prompts (numpy only, deterministic).

τ is a ratio of sums, Σ emitted / Σ cycles, over the prompts of one evaluation. Which
prompts were held out, and (under sampling) which tokens were drawn, both move it; resampling
the prompts with replacement and recomputing the ratio each time captures both, since each
prompt's counts are one draw of everything that varied. Two contestants measured on the
SAME prompts are resampled together (paired), so the interval of their relative gain leaves
out the prompt-to-prompt variation they share.

Per-prompt counts are ``(emitted_tokens, cycles)`` pairs, in prompt order. Every function
seeds its own generator: the same counts give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 20261124

Counts = Sequence[Sequence[int]]  # per prompt: (emitted_tokens, cycles)


def tau_interval(counts: Counts, level: float = LEVEL, resamples: int = RESAMPLES
                 ) -> tuple[float, float]:
    """The ``level`` percentile interval of τ; (nan, nan) without cycles."""
    table = _table(counts)
    if not len(table) or table[:, 1].sum() == 0:
        return math.nan, math.nan
    taus = _ratios(table, _indices(len(table), resamples))
    return _percentiles(taus, level)


def gain_interval(candidate: Counts, baseline: Counts, level: float = LEVEL,
                  resamples: int = RESAMPLES) -> tuple[float, float]:
    """The ``level`` interval of τ_candidate / τ_baseline − 1, resampling prompts jointly.
    Both must list the same prompts in the same order."""
    a, b = _table(candidate), _table(baseline)
    if len(a) != len(b):
        raise ValueError(f"paired counts need the same prompts: {len(a)} vs {len(b)}")
    if not len(a) or a[:, 1].sum() == 0 or b[:, 1].sum() == 0:
        return math.nan, math.nan
    index = _indices(len(a), resamples)
    gains = _ratios(a, index) / _ratios(b, index) - 1.0
    return _percentiles(gains, level)


def stratified_gain_interval(candidate: Sequence[Counts], baseline: Sequence[Counts] | None,
                             weights: Sequence[float], level: float = LEVEL,
                             resamples: int = RESAMPLES) -> tuple[float, float]:
    """The ``level`` interval of the weighted gain Σ w_s τ_c,s / Σ w_s τ_b,s − 1 when the two
    drafters were measured on different samples within the same strata (rollouts of the
    same RL steps, served side by side): within each stratum each drafter's counts are
    resampled on their own, and both drafters' per-stratum τ are combined with the SAME
    weights ``w_s``, so a stratum where one of them served more rollouts than the other
    does not tilt the comparison. ``candidate[i]``, ``baseline[i]`` and ``weights[i]``
    belong to stratum i. ``baseline`` None: τ 1 in every stratum (no drafter)."""
    if baseline is not None and len(baseline) != len(candidate) \
            or len(weights) != len(candidate):
        raise ValueError(f"stratified counts need the same strata: {len(candidate)} vs "
                         f"{len(baseline) if baseline is not None else '-'} and "
                         f"{len(weights)} weights")
    rng = np.random.default_rng(SEED)
    w = np.asarray(weights, dtype=np.float64)
    top = _weighted(candidate, w, rng, resamples)
    bottom = _weighted(baseline, w, rng, resamples) if baseline is not None else w.sum()
    if top is None or bottom is None:
        return math.nan, math.nan
    return _percentiles(top / bottom - 1.0, level)


def _weighted(strata: Sequence[Counts], weights: np.ndarray, rng: np.random.Generator,
              resamples: int) -> np.ndarray | None:
    """Σ_s w_s τ_s of each resample (R,), τ_s from stratum s's counts resampled within it;
    None when a stratum has no cycle at all."""
    total = np.zeros(resamples)
    for counts, weight in zip(strata, weights, strict=True):
        table = _table(counts)
        if not len(table) or table[:, 1].sum() == 0:
            return None
        index = rng.integers(0, len(table), size=(resamples, len(table)))
        total += weight * _ratios(table, index)
    return total


def _table(counts: Counts) -> np.ndarray:
    table = np.asarray(counts, dtype=np.float64).reshape(-1, 2)  # (P, 2)
    if (table < 0).any():
        raise ValueError("per-prompt counts must be >= 0")
    return table


def _indices(prompts: int, resamples: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return rng.integers(0, prompts, size=(resamples, prompts))  # (R, P)


def _ratios(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Σ emitted / Σ cycles of each resample (NaN for one without cycles, left out of the
    percentiles)."""
    emitted, cycles = table[index, 0].sum(axis=1), table[index, 1].sum(axis=1)  # (R,)
    return np.where(cycles > 0, emitted / np.maximum(cycles, 1), np.nan)


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2 * 100
    lo, hi = np.nanpercentile(values, [tail, 100 - tail])
    return float(lo), float(hi)
