"""Acceptance as the RL engine saw it: τ per RL step and drafter version, from the
speculative counters of the step's rollouts (the snapshot's ``speculative`` column).

Definition, the offline evaluation's (:mod:`pipeline.evaluation.metrics`): τ = tokens emitted
by draft-verify passes ÷ passes, both summed over the rollouts before dividing. A rollout's
passes are its ``verify_ct``; what they emitted is ``completion_tokens - 1`` where the engine
counts completion tokens (the prefill token is no pass's), else ``accepted_tokens +
verify_ct`` (each pass adds its bonus token). The interval is the evaluation's bootstrap over
rollouts (:func:`pipeline.evaluation.confidence.tau_interval`). A rollout claiming more
tokens per pass than its drafter's served draft depth allows is left out and counted
(``impossible``): the record contract checks the counters against the response, and this
bounds what it cannot see (a record without response ids).

Stored per step as ``observed/step=NNNNNN/acceptance.json`` (:func:`observe_step`), which the
drift trigger, the promotion check in ``manifest`` mode and the chart read back.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.layout import OBSERVED, observed_key, steps_of
from pipeline.records import from_json, to_json
from pipeline.snapshot.counters import emitted_by_passes
from pipeline.storage import Storage

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class VersionAcceptance:
    """The rollouts one drafter version drafted in one RL step."""

    drafter_version: str  # registry version ("none": the engine ran without a drafter)
    rollouts: int
    verify_ct: int
    emitted: int  # tokens the verify passes emitted
    tau: float | None  # emitted / verify_ct; None without a verify pass
    tau_low: float | None  # the 95% bootstrap interval over rollouts
    tau_high: float | None
    per_rollout: tuple[tuple[int, int], ...] = ()  # (emitted, verify passes) per rollout
    impossible: int = 0  # rollouts left out: more tokens per pass than the drafter can emit


@dataclass(frozen=True)
class StepAcceptance:
    """What the engine reported for one RL step: per drafter version, and how many of the
    step's rollouts carried counters at all."""

    step: int
    rollouts: int
    with_counters: int
    versions: tuple[VersionAcceptance, ...]
    schema_version: int = SCHEMA_VERSION

    def of(self, version: str) -> VersionAcceptance | None:
        return next((v for v in self.versions if v.drafter_version == version), None)


def rollout_counts(spec: Mapping[str, Any]) -> tuple[int, int]:
    """(tokens emitted by verify passes, verify passes) of one rollout's counters."""
    return emitted_by_passes(spec), int(spec["verify_ct"])


def summarise(step: int, counters: Iterable[Mapping[str, Any] | None],
              pass_limits: Mapping[str, int] | None = None) -> StepAcceptance:
    """:class:`StepAcceptance` of the ``speculative`` values of one step's rollouts (None:
    a rollout without counters). ``pass_limits``: the most tokens one verify pass of a
    version can emit (its drafter's draft depth + 1, :func:`pass_limits`); a rollout
    claiming more per pass is left out of τ and counted as ``impossible``, so no single
    rollout moves a version's τ past what its drafter could produce."""
    from pipeline.evaluation.confidence import tau_interval

    limits = pass_limits or {}
    per_version: dict[str, list[tuple[int, int]]] = defaultdict(list)
    impossible: dict[str, int] = defaultdict(int)
    rollouts = 0
    for spec in counters:
        rollouts += 1
        if spec is None:
            continue
        version, (emitted, verify) = spec["drafter_version"], rollout_counts(spec)
        if version in limits and emitted > verify * limits[version]:
            impossible[version] += 1
        else:
            per_version[version].append((emitted, verify))
    versions = []
    for version in sorted(per_version.keys() | impossible.keys()):
        counts = per_version[version]
        emitted, verify = sum(c[0] for c in counts), sum(c[1] for c in counts)
        low, high = tau_interval(counts) if verify else (math.nan, math.nan)
        versions.append(VersionAcceptance(
            version, len(counts), verify, emitted, emitted / verify if verify else None,
            _finite(low), _finite(high), tuple(counts), impossible[version]))
    with_counters = sum(len(c) for c in per_version.values()) + sum(impossible.values())
    return StepAcceptance(step, rollouts, with_counters, tuple(versions))


def pass_limits(storage: Storage, name: str) -> dict[str, int]:
    """The most tokens one verify pass can emit, per registry version ``name`` ever served:
    the deepest draft it was served with (``num_steps``) plus the pass's own token."""
    from pipeline.serving_now import serving_history

    limits: dict[str, int] = {}
    for manifest in serving_history(storage, name):
        if manifest.target is not None:
            version = manifest.target.registry_version
            limits[version] = max(limits.get(version, 0), manifest.settings.num_steps + 1)
    return limits


def observe_step(storage: Storage, step: int, name: str | None = None) -> StepAcceptance:
    """Summarise step ``step``'s validated snapshot and store the result (a re-run rewrites
    it with the same numbers); ``name``: the registered model whose serving history bounds
    each version's tokens per pass."""
    from pipeline.snapshot.stage import read_accepted

    column = read_accepted(storage, step).column("speculative").to_pylist()
    observed = summarise(step, column, pass_limits(storage, name) if name else None)
    storage.write_bytes(observed_key(step), to_json(observed).encode())
    return observed


def read_observed(storage: Storage, step: int) -> StepAcceptance | None:
    """The stored summary of ``step``, or None when none was stored."""
    try:
        data = storage.read_bytes(observed_key(step))
    except FileNotFoundError:
        return None
    return from_json(StepAcceptance, data)


def observed_series(storage: Storage, since: int = 0) -> list[StepAcceptance]:
    """Every stored summary from RL step ``since`` on, oldest first."""
    found = (read_observed(storage, s) for s in steps_of(storage.list_dirs(OBSERVED))
             if s >= since)
    return [o for o in found if o is not None]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
