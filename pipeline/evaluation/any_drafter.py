"""Measuring any drafter on a committed RL step: what ``aerie eval`` runs.

A drafter directory in SGLang's EAGLE-3 layout (``config.json`` and ``model.safetensors``),
trained by Aerie or not, is measured against the policy of RL step ``step`` on the held-out
prompts of ``window`` (steps whose hidden-state shards are committed). No drafter is measured
beside it, always. The contest is the evaluation stage's (:func:`.evaluators.measure`, by
any evaluator: Aerie's in-process engine or a serving engine's servers): the sampler
the rollouts recorded unless the config overrides it, the same seeds, bootstrap intervals
and the lossless checks. Nothing is published.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.capture.heldout import heldout_prompts
from pipeline.eagle3.export import WEIGHTS_NAME
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.contest import NO_DRAFTER, Contestant
from pipeline.evaluation.evaluators import INPROCESS, Evaluator, label, measure
from pipeline.evaluation.regime import resolve_sampler
from pipeline.layout import SHARDS, committed_steps
from pipeline.storage import Storage

DRAFTER = "drafter"


@dataclass(frozen=True)
class DrafterMeasurement:
    """Every contestant of one ``aerie eval``, and what it was measured on."""

    step: int
    window: tuple[int, ...]
    prompts: int
    lossless_prompts: int
    sampler: str  # its label, e.g. "greedy" or "T=1"
    sampler_source: str
    settings: dict[str, Any]
    device: str
    dtype: str
    confidence: float
    contestants: dict[str, Contestant]
    evaluator: str  # inprocess, or the engine and its version, e.g. "sglang 0.5.23"

    reference_prompts: int  # also decoded by the cache-free greedy reference

    def rows(self) -> list[dict[str, Any]]:
        """One row per contestant: τ, its interval, α per draft position, and how many
        prompts matched greedy decoding without a drafter and the cache-free reference
        (``near_ties``: mismatches of either check at a bf16 near-tie). None: not a
        number (no cycle was measured, or a position was never attempted)."""
        out = []
        for name, c in self.contestants.items():
            stats = c.acceptance
            out.append({"contestant": name, "uri": c.uri, "tau": _number(c.tau),
                        "tau_interval": [_number(x) for x in c.tau_interval],
                        "alpha": [_number(a) for a in stats.alpha],
                        "matches_greedy": f"{c.outputs_match_baseline}/{self.lossless_prompts}",
                        "matches_reference": f"{c.outputs_match_reference}/"
                                             f"{self.reference_prompts}",
                        "near_ties": c.ties})
        return out


def _number(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def shard_steps(storage: Storage) -> list[int]:
    """The RL steps whose hidden-state shards are committed, ascending."""
    return committed_steps(storage.list(SHARDS), SHARDS)


def measure_drafter(storage: Storage, step: int, drafter: Path | None,
                    window: Sequence[int], config: EvalConfig = EvalConfig(), *,
                    uri: str | None = None, fingerprint: str | None = None,
                    evaluator: Evaluator = INPROCESS) -> DrafterMeasurement:
    """``drafter`` (None: no drafter only) against the policy of ``step`` on the held-out
    prompts of ``window``; ``uri`` and ``fingerprint`` name it in the result (default: the
    directory, no fingerprint). A missing file of the drafter is a ``FileNotFoundError``
    naming it, before the policy is loaded."""
    drafters = {}
    if drafter is not None:
        for name in ("config.json", WEIGHTS_NAME):
            if not (Path(drafter) / name).is_file():
                raise FileNotFoundError(f"drafter {drafter}: no {name} (expected SGLang's "
                                        "EAGLE-3 layout: config.json + model.safetensors)")
        drafters[DRAFTER] = (Path(drafter), uri or str(drafter), fingerprint)
    _, prompts = heldout_prompts(storage, window, config.max_prompts)
    sampler, source = resolve_sampler(storage, step, config)
    m = measure(evaluator, storage, step, [list(p.prompt_ids) for p in prompts], config,
                sampler, source, drafters)
    order = [NO_DRAFTER, *drafters]
    return DrafterMeasurement(
        step=step, window=tuple(window), prompts=len(prompts),
        lossless_prompts=len(m.checked), reference_prompts=m.reference_prompts,
        sampler=sampler.label,
        sampler_source=source, settings=m.settings, device=m.device, dtype=m.dtype,
        confidence=config.confidence, contestants={k: m.contestants[k] for k in order},
        evaluator=label(m.evaluator))
