"""Stage 7b, ``serving_drafter``: the gate's decision on a refresh step, and promotion.

``run`` turns the step's acceptance report into gate inputs
(:func:`pipeline.release.gate.decide`) and calls :func:`pipeline.release.promotion.promote`,
or :func:`pipeline.release.canary.start_canary` when canaries are configured.

Invariant: the champion the gate compares against is the version the report measured
(found by its fingerprint); promotion refuses a decision whose champion has since changed,
and a report without a champion while one exists is refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.algorithms import format_errors
from pipeline.evaluation.stage import NO_DRAFTER, AcceptanceReport, Contestant
from pipeline.layout import drafter_prefix
from pipeline.release.backend import ServingBackend
from pipeline.release.canary import CanaryPlan, start_canary
from pipeline.release.gate import Candidate, Decision, EvalSummary, GatePolicy, decide
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import PromotionResult, promote
from pipeline.release.register import ReleaseError, read_refresh_report
from pipeline.storage import Storage
from pipeline.training.stage import DRAFTER_KIND
from pipeline.verified import fetch


@dataclass(frozen=True)
class Released:
    decision: Decision
    promotion: PromotionResult
    candidate: str  # the registry version the gate decided on


def run(storage: Storage, registry: DrafterRegistry, serving: ServingBackend,
        step: int, policy: GatePolicy, *, dagster_run_id: str | None = None,
        canary: CanaryPlan | None = None) -> Released:
    """Ask the gate about the drafter of ``step`` and promote it if the gate says so: to
    every server, or first as a canary on ``canary``'s servers from RL step ``step + 1``."""
    report = read_refresh_report(storage, step)
    cand = report.contestants["candidate"]
    version = registry.find_version(cand.fingerprint)
    if version is None:
        raise ReleaseError(f"drafter {cand.fingerprint} of step {step} is not registered: "
                           f"materialize registered_drafter first")
    local = fetch(storage, drafter_prefix(step), kind=DRAFTER_KIND, label="drafter")
    errors = format_errors(local)
    champion = None
    if "champion" in report.contestants:
        measured = report.contestants["champion"]
        found = registry.find_version(measured.fingerprint)
        champion = _summary(report, measured, found.version if found else None)
    decision = decide(Candidate(_summary(report, cand, version.version), not errors, errors),
                      champion, _summary(report, report.contestants[NO_DRAFTER], None), policy)
    if canary is not None and canary.enabled:
        result = start_canary(registry, serving, version.version, decision, canary,
                              started_at=step + 1, dagster_run_id=dagster_run_id)
    else:
        result = promote(registry, serving, version.version, decision,
                         dagster_run_id=dagster_run_id)
    return Released(decision, result, version.version)


def _summary(report: AcceptanceReport, c: Contestant, version: str | None) -> EvalSummary:
    s = c.acceptance
    return EvalSummary(tau=s.tau, cycles=s.cycles, emitted_tokens=s.emitted_tokens,
                       alpha=tuple(s.alpha), settings_key=report.settings_key,
                       heldout_key=report.heldout_key, drafter_version=version,
                       sampler_key=report.sampler_key,
                       per_prompt=tuple(tuple(p) for p in c.per_prompt))
