"""Quality checks of the refresh stages, as plain functions (the assets report them to Dagster).

Each check looks at what a stage produced and answers pass/fail with the numbers behind the
answer. They are meant to catch the failures that really happen: shards damaged after they
were written, a draft vocab that misses too much of the policy's output, a training run that
diverged or learned nothing, an evaluation whose speculative outputs differ from plain greedy
decoding (a drafter/engine bug that would make every τ meaningless).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.evaluation.stage import AcceptanceReport
from pipeline.layout import shards_prefix
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.storage import Storage

MIN_VOCAB_COVERAGE = 0.9  # share of loss-masked tokens the draft vocab can propose


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str  # why, in words (shown in the UI)
    metadata: dict[str, Any] = field(default_factory=dict)


def shard_integrity(storage: Storage, step: int) -> CheckOutcome:
    """Re-hash every shard of ``step`` against its manifest (size and sha256)."""
    prefix = shards_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        return CheckOutcome(False, f"{storage.url(prefix)}: no committed manifest")
    problems = verify_manifest(storage, prefix, manifest)
    files = len(manifest.files)
    text = (f"{files} files match their manifest checksums" if not problems
            else f"{len(problems)} of {files} files differ from the manifest: "
                 + "; ".join(problems[:5]))
    return CheckOutcome(not problems, text, {"files": files, "problems": len(problems)})


def vocab_coverage(coverage: float, threshold: float = MIN_VOCAB_COVERAGE) -> CheckOutcome:
    """The draft vocab must cover at least ``threshold`` of the window's masked tokens."""
    ok = math.isfinite(coverage) and coverage >= threshold
    return CheckOutcome(ok, f"coverage {coverage:.4f} {'≥' if ok else '<'} {threshold}",
                        {"coverage": coverage, "threshold": threshold})


def training_loss(first: float, final: float, history: Sequence[float]) -> CheckOutcome:
    """Every logged loss is finite, and the loss at the end is below the loss at the start."""
    bad = [i for i, x in enumerate(history) if not math.isfinite(x)]
    finite = not bad and math.isfinite(first) and math.isfinite(final)
    meta = {"first_loss": first, "final_loss": final, "logged_steps": len(history),
            "finite": finite}
    if not finite:
        return CheckOutcome(False, f"non-finite loss at {len(bad)} of {len(history)} logged "
                                   f"steps (first {first}, final {final})", meta)
    ok = final < first
    return CheckOutcome(ok, f"loss {first:.4f} → {final:.4f}"
                            + ("" if ok else ": not falling"), meta)


def evaluation_sound(report: AcceptanceReport) -> CheckOutcome:
    """Every drafter's outputs equal greedy decoding on every prompt (speculative decoding is
    lossless), and each drafter was measured (cycles > 0, finite τ). A failure means the
    measurement cannot be trusted, so nothing may be promoted on it. (Whether there were
    enough cycles for a decision is the gate's question, not this check's.)"""
    prompts = report.heldout["prompts"]
    problems = []
    for name, c in sorted(report.contestants.items()):
        if c.outputs_match_baseline != prompts:
            problems.append(f"{name}: {c.outputs_match_baseline}/{prompts} prompts match "
                            "greedy decoding")
        if name == "no_drafter":
            continue
        stats = c.acceptance
        if stats.cycles == 0 or not math.isfinite(stats.tau):
            problems.append(f"{name}: τ {stats.tau:.3f} over {stats.cycles} cycles")
    text = "; ".join(problems) or (f"all {len(report.contestants)} contestants lossless on "
                                   f"{prompts} prompts")
    return CheckOutcome(not problems, text, {"prompts": prompts, "problems": len(problems)})
