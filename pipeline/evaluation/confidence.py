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
                             level: float = LEVEL, resamples: int = RESAMPLES
                             ) -> tuple[float, float]:
    """The ``level`` interval of τ_candidate / τ_baseline − 1 when the two were measured on
    different samples within the same strata (rollouts of the same RL steps, served by two
    drafters side by side): each stratum's counts are resampled within it, separately per
    drafter, and pooled over the strata. ``candidate[i]`` and ``baseline[i]`` are stratum
    i's counts. ``baseline`` None: τ 1 (no drafter), so the gain is τ_candidate − 1."""
    if baseline is not None and len(baseline) != len(candidate):
        raise ValueError(f"stratified counts need the same strata: {len(candidate)} vs "
                         f"{len(baseline)}")
    rng = np.random.default_rng(SEED)
    top = _pooled(candidate, rng, resamples)
    bottom = _pooled(baseline, rng, resamples) if baseline is not None else None
    if top is None or (baseline is not None and bottom is None):
        return math.nan, math.nan
    gains = top - 1.0 if bottom is None else top / bottom - 1.0
    return _percentiles(gains, level)


def _pooled(strata: Sequence[Counts], rng: np.random.Generator, resamples: int
            ) -> np.ndarray | None:
    """Σ emitted / Σ cycles over the strata, each resampled within itself (R,); None when
    no stratum has a cycle."""
    emitted, cycles = np.zeros(resamples), np.zeros(resamples)
    for counts in strata:
        table = _table(counts)
        if not len(table):
            continue
        index = rng.integers(0, len(table), size=(resamples, len(table)))
        emitted += table[index, 0].sum(axis=1)
        cycles += table[index, 1].sum(axis=1)
    if not cycles.any():
        return None
    return np.where(cycles > 0, emitted / np.maximum(cycles, 1), np.nan)


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
