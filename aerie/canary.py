"""What ``aerie canary`` prints: the verdict on two drafter versions served side by side,
from the RL engine's counters Aerie stored for each ingested RL step."""

from __future__ import annotations

from pipeline.monitor.canary import CanaryVerdict
from pipeline.monitor.observed import StepAcceptance


def render(verdict: CanaryVerdict, series: list[StepAcceptance]) -> str:
    """The verdict and its reason, then one line per RL step counted: τ and verify passes
    of each drafter."""
    lines = [f"verdict:  {verdict.action}", f"why:      {verdict.reason}"]
    steps = set(verdict.evidence.steps) if verdict.evidence else None
    rows = []
    for observed in series:
        if steps is not None and observed.step not in steps:
            continue
        cells = []
        for version in (verdict.candidate, verdict.champion):
            v = observed.of(version)
            label = "no drafter" if version == "none" else f"v{version}"
            cells.append(f"{label} " + ("–" if v is None or v.tau is None else
                                        f"τ {v.tau:.3f} ({v.verify_ct} passes)"))
        rows.append(f"  RL step {observed.step}: " + ", ".join(cells))
    if rows:
        lines += ["counted:" if steps is not None else "seen:", *rows]
    return "\n".join(lines)
