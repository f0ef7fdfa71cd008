"""Stage 7a, ``registered_drafter``: register a refresh step's evaluated drafter.

``run`` joins what the earlier stages committed for step s (the drafter manifest's lineage
and the acceptance report) and publishes it to the MLflow registry (alias ``challenger``).

Invariant: the report must have measured exactly the drafter being registered (same
fingerprint), or registration refuses: numbers are never attached to another drafter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.evaluation.stage import AcceptanceReport, read_report
from pipeline.layout import drafter_prefix
from pipeline.manifest import read_manifest
from pipeline.release.lineage import lineage_from_manifest
from pipeline.release.mlflow_registry import DrafterRegistry, Registration
from pipeline.storage import Storage
from pipeline.training.curve import read_curve
from pipeline.training.stage import DRAFTER_KIND
from pipeline.verified import fetch


class ReleaseError(RuntimeError):
    """The committed stages of a refresh step do not fit together."""


@dataclass(frozen=True)
class Registered:
    registration: Registration
    tau: float


def run(storage: Storage, registry: DrafterRegistry, step: int, dagster_run_id: str,
        *, run_tags: Mapping[str, str] | None = None) -> Registered:
    """Log and register the drafter of ``step`` with its lineage and evaluation."""
    prefix = drafter_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        raise ReleaseError(f"{storage.url(prefix)}: no committed drafter for step {step}")
    report = read_refresh_report(storage, step)
    candidate = report.contestants["candidate"]
    if candidate.fingerprint != manifest.meta["fingerprint"]:
        raise ReleaseError(f"the acceptance report of step {step} measured drafter "
                           f"{candidate.fingerprint}, not the committed "
                           f"{manifest.meta['fingerprint']}: re-run acceptance_eval")
    stats = candidate.acceptance
    lineage = lineage_from_manifest(
        manifest.meta, drafter_uri=prefix, policy_uri=report.policy_uri,
        tau=stats.tau, alpha=stats.alpha, dagster_run_id=dagster_run_id,
        heldout_key=report.heldout_key, settings_key=report.settings_key,
        settings=report.settings, eval_fingerprint=report.fingerprint,
        regime=report.regime, sampler_key=report.sampler_key)
    local = fetch(storage, prefix, kind=DRAFTER_KIND, label="drafter")  # verified copy
    registration = registry.publish(
        drafter_dir=local, lineage=lineage, params=manifest.meta.get("config"),
        history=read_curve(storage, prefix, manifest), metrics=_eval_metrics(report),
        run_name=f"drafter-step-{step:06d}", run_tags=run_tags)
    return Registered(registration, stats.tau)


def read_refresh_report(storage: Storage, step: int) -> AcceptanceReport:
    report = read_report(storage, step)
    if report is None:
        raise ReleaseError(f"no acceptance report for step {step}: materialize "
                           f"acceptance_eval first")
    return report


def _eval_metrics(report: AcceptanceReport) -> dict[str, float]:
    """τ, its interval and α per contestant, under the regime's name (``eval/greedy/...``,
    ``eval/T1_top_p0.9/...``): greedy and sampled τ never share a chart."""
    regime = report.sampling.slug
    out: dict[str, float] = {}
    for name, c in report.contestants.items():
        s = c.acceptance
        out[f"eval/{regime}/{name}_tau"] = s.tau
        if c.tau_interval:
            out[f"eval/{regime}/{name}_tau_lo"], out[f"eval/{regime}/{name}_tau_hi"] = \
                c.tau_interval
        for k, a in enumerate(s.alpha):
            if not math.isnan(a):
                out[f"eval/{regime}/{name}_alpha_{k}"] = a
    return out
