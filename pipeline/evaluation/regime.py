"""The regime an evaluation measures in: which sampler, from where, under which key.

Torch-free. The sampler is the one the rollouts were generated with: the settings the newest
committed rollout snapshot up to the evaluated step records (a step that records none
defers to an earlier one), with each field the run config sets overriding it; greedy when
no snapshot records any. :func:`sampler_key` is what the gate compares: equal for equal
samplers, every greedy setting folded into one.
"""

from __future__ import annotations

import hashlib
import json

from pipeline.evaluation.config import EvalConfig
from pipeline.layout import SNAPSHOTS, committed_steps
from pipeline.sampling import SamplingParams
from pipeline.snapshot.stage import recorded_sampling
from pipeline.storage import Storage


def resolve_sampler(storage: Storage, step: int, config: EvalConfig
                    ) -> tuple[SamplingParams, str]:
    """The sampler to measure at, and where it came from (for the report and the log)."""
    recorded = newest_recorded_sampling(storage, step)
    sampler = config.sampler(recorded[1] if recorded else None)
    if recorded is None:
        source = "no rollout snapshot up to this step records sampler settings: greedy"
    else:
        source = f"recorded by the rollout snapshot of step {recorded[0]}"
    if config.overrides_sampler:
        source += "; overridden by the run config"
    return sampler, source


def newest_recorded_sampling(storage: Storage, step: int
                             ) -> tuple[int, SamplingParams] | None:
    """The newest committed snapshot step <= ``step`` that records sampler settings."""
    for s in sorted((s for s in committed_steps(storage.list(SNAPSHOTS), SNAPSHOTS)
                     if s <= step), reverse=True):
        found = recorded_sampling(storage, s)
        if found is not None:
            return s, found
    return None


def sampler_key(sampler: SamplingParams) -> str:
    """The regime's key: equal for equal samplers (every greedy one folded into one)."""
    blob = json.dumps(sampler.canonical().to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
