"""Quality checks of the refresh stages, as plain functions (the assets report them to Dagster).

Each check looks at what a stage produced and answers pass/fail with the numbers behind the
answer. They are meant to catch the failures that really happen: shards damaged after they
were written, a draft vocab that misses too much of the policy's output, a training run that
diverged or learned nothing, an evaluation whose speculative outputs differ from plain greedy
decoding (a drafter/engine bug that would make every τ meaningless), a serving drafter that
went stale while the policy moved on (refreshes refused or not running).

Importing this module is cheap (no torch): the Dagster definitions import it to declare the
checks, and the evaluation stage is imported only by the functions that read reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.layout import DRAFTERS, EVALS, shards_prefix, step_of_prefix, steps_of
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.serving_now import read_serving, serving_drafter_key
from pipeline.storage import Storage, StorageError

if TYPE_CHECKING:
    from pipeline.evaluation.stage import AcceptanceReport

MIN_VOCAB_COVERAGE = 0.9  # share of loss-masked tokens the draft vocab can propose
STALE_AFTER_STEPS = 8  # RL steps past the serving drafter's window before it is stale
MAX_TAU_DROP = 0.10  # relative fall of the serving drafter's τ since its promotion


@dataclass(frozen=True)
class CheckOutcome:
    """A check's answer. ``passed`` None: nothing established (a verification pending, or
    nothing to verify); the assets report no result for it, so the check is not green."""

    passed: bool | None
    description: str  # why, in words (shown in the UI)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def established(self) -> bool:
        return self.passed is not None


def shard_integrity(storage: Storage, step: int) -> CheckOutcome:
    """Re-hash every shard of ``step`` against its manifest (size and sha256)."""
    prefix = shards_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        return CheckOutcome(False, f"{storage.url(prefix)}: no committed manifest")
    deleted = manifest.meta.get("deleted")
    if deleted:
        return CheckOutcome(False, f"{storage.url(prefix)}: {deleted['files']} files deleted "
                                   f"by storage retention at {deleted['at']} (manifest kept)")
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
    """Every drafter's greedy outputs equal no drafter's on every checked prompt (all of
    them in a greedy evaluation, the reference sample in a sampled one: speculative decoding
    is lossless), every contestant's equal the independent reference's on the sampled prompts
    (the engine is right), and each drafter was measured (cycles > 0, finite τ). In bf16 a
    divergence at a near-tie (``pipeline.evaluation.reference.TIE_TOLERANCE``) is counted,
    not failed; fp32 is held exact. On an engine the no-drafter server is the reference and
    judges near-ties by its own log-probabilities (``pipeline.evaluation.on_engine``). A
    failure means the
    measurement cannot be trusted, so nothing may be promoted on it. (Whether there were
    enough cycles for a decision is the gate's question, not this check's.)"""
    prompts, sampled = report.checked_prompts, report.reference.get("prompts", 0)
    problems = []
    ties = sum(c.ties for c in report.contestants.values())
    kind = report.dtype if report.evaluator_kind == "inprocess" else report.evaluator_kind
    for name, c in sorted(report.contestants.items()):
        exact = c.outputs_match_baseline + c.outputs_match_reference
        if exact + c.ties < prompts + sampled:  # a mismatch that is not a near-tie (bf16)
            tied = f" ({c.ties} diverged at {kind} near-ties)" if c.ties else ""
            if c.outputs_match_baseline != prompts:
                problems.append(f"{name}: {c.outputs_match_baseline}/{prompts} prompts match "
                                f"greedy decoding{tied}")
            if c.outputs_match_reference != sampled:
                problems.append(f"{name}: {c.outputs_match_reference}/{sampled} sampled "
                                f"prompts match the cache-free reference{tied}")
        if name == "no_drafter":
            continue
        stats = c.acceptance
        if stats.cycles == 0 or not math.isfinite(stats.tau):
            problems.append(f"{name}: τ {stats.tau:.3f} over {stats.cycles} cycles")
    text = "; ".join(problems) or (f"all {len(report.contestants)} contestants lossless on "
                                   f"{prompts} prompts (greedy, token for token"
                                   + (f"; {ties} divergences at {kind} near-ties"
                                      if ties else "") + ")")
    if report.evaluator_kind != "inprocess":
        text += (f" (on {report.evaluator_kind}: the server without a drafter is the "
                 f"reference)")
    elif not sampled:
        text += " (no cache-free reference: a report from before schema 2)"
    return CheckOutcome(not problems, text, {"prompts": prompts, "problems": len(problems),
                                             "reference_prompts": sampled})


@dataclass(frozen=True)
class ServingState:
    """The drafter serving now, as the staleness check sees it: the end of its training
    window and its τ, at promotion (as the candidate of its own refresh) and last measured
    (as candidate or champion of the newest report that measured it)."""

    version: str  # registry version ("" when the serving record names none)
    drafter: str  # storage key of the drafter directory
    window_end: int  # last RL step of its training window
    tau_at_promotion: float | None = None
    last_tau: float | None = None
    last_tau_step: int | None = None  # refresh step of the report that measured last_tau


def staleness(state: ServingState | None, newest_step: int | None, *,
              stale_after_steps: int = STALE_AFTER_STEPS,
              max_tau_drop: float = MAX_TAU_DROP) -> CheckOutcome:
    """Stale when the newest ingested RL step is more than ``stale_after_steps`` past the end
    of the serving drafter's window, or when its last measured τ fell by more than
    ``max_tau_drop`` (a share) below its τ at promotion. Nothing serving is never stale."""
    meta: dict[str, Any] = {"stale_after_steps": stale_after_steps,
                            "max_tau_drop": max_tau_drop}
    if state is None:
        return CheckOutcome(True, "no drafter is serving: nothing can go stale", meta)
    behind = max(0, newest_step - state.window_end) if newest_step is not None else 0
    meta.update(version=state.version, drafter=state.drafter, window_end=state.window_end,
                steps_behind=behind)
    if newest_step is not None:
        meta["newest_step"] = newest_step
    problems = []
    if behind > stale_after_steps:
        problems.append(f"{behind} RL steps past its training window (ends at step "
                        f"{state.window_end}; newest ingested {newest_step}), more than "
                        f"{stale_after_steps}")
    drop = _relative_drop(state.tau_at_promotion, state.last_tau)
    for key in ("tau_at_promotion", "last_tau", "last_tau_step"):
        if getattr(state, key) is not None:
            meta[key] = getattr(state, key)
    if drop is not None:
        meta["tau_drop"] = drop
        if drop > max_tau_drop:
            problems.append(f"τ fell {drop:.1%} since promotion ({state.tau_at_promotion:.3f} "
                            f"→ {state.last_tau:.3f} at refresh step {state.last_tau_step}), "
                            f"more than {max_tau_drop:.1%}")
    who = f"v{state.version}" if state.version else state.drafter
    if problems:
        return CheckOutcome(False, f"serving drafter {who} is stale: " + "; ".join(problems),
                            meta)
    tau = f", τ {state.last_tau:.3f} (at promotion {state.tau_at_promotion:.3f})" \
        if drop is not None else ""
    return CheckOutcome(True, f"serving drafter {who}: {behind} RL steps past its window"
                              f"{tau}", meta)


def _relative_drop(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or not (math.isfinite(before) and math.isfinite(after)) \
            or before <= 0:
        return None
    return max(0.0, 1.0 - after / before)


def serving_state(storage: Storage, name: str) -> ServingState | None:
    """What :func:`staleness` judges, read from storage: the serving record of ``name``, its
    drafter's manifest (``window_steps``, ``fingerprint``) and the acceptance reports from
    the drafter's own refresh step on, newest first until one measured it in the regime of
    its promotion (usually the newest: every refresh measures the champion, at the
    sampler the rollouts record). None when nothing is served; ValueError
    when the serving drafter cannot be read (outside this storage root, no manifest)."""
    from pipeline.evaluation.stage import read_report

    record = read_serving(storage, name)
    if record is None or record.target is None:
        return None
    try:
        key = serving_drafter_key(storage, name)
    except StorageError as e:  # served from outside this storage root
        raise ValueError(str(e)) from e
    drafter = read_manifest(storage, key) if key else None
    if drafter is None or not drafter.meta.get("window_steps"):
        raise ValueError(f"serving drafter {record.target.drafter_uri} has no readable "
                         f"manifest with window_steps under {storage.url()}")
    fingerprint = drafter.meta.get("fingerprint") or record.target.fingerprint
    own_step = step_of_prefix(key, DRAFTERS)

    def tau_in(step: int, names: Sequence[str]) -> tuple[float, str] | None:
        """(τ, comparable key) of the serving drafter in ``step``'s report, if it was
        measured."""
        report = read_report(storage, step)
        found = [(report.contestants[n].tau, report.comparable_key) for n in names
                 if report is not None and n in report.contestants
                 and report.contestants[n].fingerprint == fingerprint]
        return found[0] if found else None

    promoted = tau_in(own_step, ("candidate",)) if own_step is not None else None
    last = last_step = None
    other_regime = False
    for step in reversed(steps_of(storage.list_dirs(EVALS))):
        if own_step is not None and step < own_step:
            break
        measured = tau_in(step, ("champion", "candidate"))
        if measured is None:
            continue
        if promoted is not None and measured[1] != promoted[1]:
            other_regime = True  # greedy vs sampled τ (or in-process vs engine τ) is no drop
            # or rise: look further back
            continue
        if step == own_step and other_regime:
            break  # measured since only in another regime: the drop cannot be judged
        last, last_step = measured[0], step
        break
    return ServingState(record.target.registry_version, key, max(drafter.meta["window_steps"]),
                        promoted[0] if promoted else None, last, last_step)


def serving_staleness(storage: Storage, name: str, newest_step: int | None, *,
                      stale_after_steps: int = STALE_AFTER_STEPS,
                      max_tau_drop: float = MAX_TAU_DROP) -> CheckOutcome:
    """:func:`staleness` of the drafter serving ``name`` now; a serving drafter that cannot
    be read fails the check with the reason."""
    try:
        state = serving_state(storage, name)
    except ValueError as e:
        return CheckOutcome(False, f"staleness unknown: {e}",
                            {"stale_after_steps": stale_after_steps,
                             "max_tau_drop": max_tau_drop})
    return staleness(state, newest_step, stale_after_steps=stale_after_steps,
                     max_tau_drop=max_tau_drop)
