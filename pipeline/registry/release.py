"""A refresh step's release: register its evaluated drafter, then promote it through the gate.

``register_refresh`` joins what the earlier stages committed for step s (the drafter
manifest's lineage and the acceptance report) and publishes it to the registry;
``release_refresh`` turns the report into gate inputs and calls
:func:`pipeline.registry.promotion.promote`.

Invariants:

- The report must have measured exactly the drafter being registered (same fingerprint),
  or registration refuses: numbers are never attached to another drafter.
- The champion the gate compares against is the version the report measured (found by its
  fingerprint); promotion refuses a decision whose champion has since changed, and a report
  without a champion while one exists is refused the same way.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.evaluation.stage import NO_DRAFTER, AcceptanceReport, Contestant, read_report
from pipeline.manifest import read_manifest
from pipeline.registry.format_check import drafter_format_errors
from pipeline.registry.gate import Candidate, Decision, EvalSummary, GatePolicy, decide
from pipeline.registry.lineage import lineage_from_manifest
from pipeline.registry.mlflow_registry import DrafterRegistry, Registration
from pipeline.registry.promotion import PromotionResult, promote
from pipeline.serving.backend import ServingBackend
from pipeline.storage import Storage
from pipeline.training.refresh import drafter_prefix


class ReleaseError(RuntimeError):
    """The committed stages of a refresh step do not fit together."""


@dataclass(frozen=True)
class Registered:
    registration: Registration
    tau: float


@dataclass(frozen=True)
class Released:
    decision: Decision
    promotion: PromotionResult


def register_refresh(storage: Storage, registry: DrafterRegistry, step: int, dagster_run_id: str,
                     *, chart_dir: Path,
                     chart: Callable[[Mapping[str, Sequence[float]], str], bytes] | None = None
                     ) -> Registered:
    """Log and register the drafter of ``step`` with its lineage and evaluation."""
    prefix = drafter_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        raise ReleaseError(f"{storage.url(prefix)}: no committed drafter for step {step}")
    report = _report(storage, step)
    candidate = report.contestants["candidate"]
    if candidate.fingerprint != manifest.meta["fingerprint"]:
        raise ReleaseError(f"the acceptance report of step {step} measured drafter "
                           f"{candidate.fingerprint}, not the committed "
                           f"{manifest.meta['fingerprint']}: re-run acceptance_eval")
    stats = candidate.acceptance
    lineage = lineage_from_manifest(
        manifest.meta, drafter_uri=storage.url(prefix), policy_uri=report.policy_uri,
        tau=stats.tau, alpha=stats.alpha, dagster_run_id=dagster_run_id,
        heldout_key=report.heldout_key, settings_key=report.settings_key,
        settings=report.settings, eval_fingerprint=report.fingerprint)
    charts = []
    if chart is not None:
        png = chart({n: c.acceptance.alpha for n, c in report.contestants.items()
                     if n != NO_DRAFTER}, f"step {step}: α per draft position")
        charts.append(chart_dir / "acceptance_per_position.png")
        charts[-1].write_bytes(png)
    with tempfile.TemporaryDirectory(prefix="aerie-drafter-", dir=chart_dir) as tmp:
        local = storage.download_dir(prefix, Path(tmp) / "drafter")
        (local / "_manifest.json").unlink(missing_ok=True)
        registration = registry.publish(
            drafter_dir=local, lineage=lineage, params=manifest.meta.get("config"),
            history=manifest.meta["result"]["history"], metrics=_eval_metrics(report),
            charts=charts,
            run_name=f"drafter-step-{step:06d}")
    return Registered(registration, stats.tau)


def release_refresh(storage: Storage, registry: DrafterRegistry, serving: ServingBackend,
                    step: int, policy: GatePolicy, *, dagster_run_id: str | None = None
                    ) -> Released:
    """Ask the gate about the drafter of ``step`` and promote it if the gate says so."""
    report = _report(storage, step)
    cand = report.contestants["candidate"]
    version = registry.find_version(cand.fingerprint)
    if version is None:
        raise ReleaseError(f"drafter {cand.fingerprint} of step {step} is not registered: "
                           f"materialize registered_drafter first")
    with tempfile.TemporaryDirectory(prefix="aerie-release-") as tmp:
        local = storage.download_dir(drafter_prefix(step), Path(tmp) / "drafter")
        (local / "_manifest.json").unlink(missing_ok=True)
        errors = drafter_format_errors(local)
    champion = None
    if "champion" in report.contestants:
        measured = report.contestants["champion"]
        found = registry.find_version(measured.fingerprint)
        champion = _summary(report, measured, found.version if found else None)
    decision = decide(Candidate(_summary(report, cand, version.version), not errors, errors),
                      champion, _summary(report, report.contestants[NO_DRAFTER], None), policy)
    result = promote(registry, serving, version.version, decision,
                     dagster_run_id=dagster_run_id)
    return Released(decision, result)


def champion_prefix(storage: Storage, registry: DrafterRegistry) -> str | None:
    """Storage prefix of the champion's drafter (the drafter serving now), or None."""
    champion = registry.champion()
    if champion is None or champion.drafter_uri is None:
        return None
    return storage.key_of(champion.drafter_uri)


def _report(storage: Storage, step: int) -> AcceptanceReport:
    report = read_report(storage, step)
    if report is None:
        raise ReleaseError(f"no acceptance report for step {step}: materialize "
                           f"acceptance_eval first")
    return report


def _summary(report: AcceptanceReport, c: Contestant, version: str | None) -> EvalSummary:
    s = c.acceptance
    return EvalSummary(tau=s.tau, cycles=s.cycles, emitted_tokens=s.emitted_tokens,
                       alpha=tuple(s.alpha), settings_key=report.settings_key,
                       heldout_key=report.heldout_key, drafter_version=version)


def _eval_metrics(report: AcceptanceReport) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, c in report.contestants.items():
        s = c.acceptance
        out[f"eval/{name}_tau"] = s.tau
        for k, a in enumerate(s.alpha):
            if not math.isnan(a):
                out[f"eval/{name}_alpha_{k}"] = a
    return out
