"""What every evaluator returns: one :class:`Contestant` per drafter measured (no drafter
included) and how they were measured (:class:`Measurement`), and which prompts every
evaluator checks token for token (:func:`reference_sample`). Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.records import from_dict

NO_DRAFTER = "no_drafter"
INPROCESS_RECORD = {"kind": "inprocess"}  # the report's evaluator record of Aerie's engine


@dataclass(frozen=True)
class Contestant:
    """One drafter's result: where it came from and its summed acceptance counts."""

    name: str  # "candidate" | "champion" | "no_drafter"
    uri: str | None  # storage key of the drafter (None: no drafter)
    fingerprint: str | None  # the drafter manifest's fingerprint (None: no drafter)
    stats: dict[str, Any]  # AcceptanceStats.to_dict()
    outputs_match_baseline: int  # lossless_prompts whose greedy tokens equal no drafter's
    outputs_match_reference: int = 0  # reference prompts whose tokens equal the reference's
    per_prompt: list[list[int]] = field(default_factory=list)  # (emitted, cycles) per prompt
    tau_interval: list[float] = field(default_factory=list)  # [lo, hi] at report.confidence
    ties: int = 0  # mismatches (either check) that diverged at a near-tie (bf16 in process,
    # or as the no-drafter server ranks them on an engine)
    # the SpecParams it drafted with when its algorithm serves with other settings than the
    # report's (a DFlash drafter: its block's chain); None: the report's
    settings: dict[str, Any] | None = None

    @property
    def acceptance(self) -> AcceptanceStats:
        return from_dict(AcceptanceStats, self.stats)

    @property
    def tau(self) -> float:
        return self.acceptance.tau



@dataclass(frozen=True)
class Measurement:
    """What an evaluator found: every contestant, and how it was measured.

    ``checked``: indices of the prompts every drafter's greedy tokens were compared with no
    drafter's on; ``sample``: the reference sample (the longest prompts); ``reference_prompts``:
    how many of them an independent reference also decoded (0 on an engine, where the
    no-drafter server is the reference); ``evaluator``: the report's record of the evaluator
    (its kind, and for an engine its version and server arguments).
    """

    contestants: dict[str, Contestant]
    settings: dict[str, Any]  # SpecParams fields + max_new_tokens
    checked: list[int]
    sample: list[int]
    reference_prompts: int
    device: str  # where it ran: cpu/cuda in process, the engine's name on an engine
    dtype: str  # the compute dtype (an engine's as it reports it, "unknown" if it does not)
    evaluator: dict[str, Any]


def reference_sample(lengths: Sequence[int], k: int) -> list[int]:
    """Indices of the ``k`` longest prompts (ties: the earlier), in prompt order: the ones
    that reach furthest past a sliding window and exercise the cache the most."""
    ranked = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(ranked[:k])

