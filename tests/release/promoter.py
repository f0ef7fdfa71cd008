"""One promoter of the multi-host race (:func:`main`, in a process of its own started by
:func:`tests.forking.start`).

Each promoter plays a host: it evaluated its candidate while no drafter was served (a gate
decision against no drafter), waits until every promoter is ready, then calls ``promote``.
It writes what happened to ``JOB["out"]``: the result's action (or the error), and how many
serving updates it applied. With ``JOB["hold"]`` it also waits for every promoter right
before its serving update (only possible when the lock lets them all in: the planted bug).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.release.backend import LedgerBackend
from pipeline.release.gate import Candidate, decide
from pipeline.release.ledger import ServingLedger
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import promote
from pipeline.storage import Storage
from tests.release.helpers import POLICY, SETTINGS, summary


def arrive(directory: Path, phase: str, n: int, timeout_s: float = 120.0) -> None:
    """Wait until ``n`` promoters reached ``phase`` (a file each in ``directory``)."""
    (directory / f"{phase}-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while sum(1 for p in directory.iterdir() if p.name.startswith(f"{phase}-")) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of {n} promoters reached {phase}")
        time.sleep(0.01)


class CountingServing:
    """The serving backend, counting the updates it applied (and holding before each)."""

    def __init__(self, inner: LedgerBackend, hold: Callable[[], None] | None):
        self.inner, self.hold, self.applied = inner, hold, 0
        self.mode = inner.mode

    def current(self):
        return self.inner.current()

    def apply(self, target, *, reason, token=None, details=None):
        if self.hold is not None:
            self.hold()
        manifest = self.inner.apply(target, reason=reason, token=token, details=details)
        self.applied += 1
        return manifest

    def restore(self, previous, *, reason, token=None, details=None):
        return self.inner.restore(previous, reason=reason, token=token, details=details)


def main(job: dict) -> None:
    registry = DrafterRegistry.connect(job["tracking"], job["family"],
                                       artifact_location=job["artifacts"],
                                       lock_url=job.get("lock_url"),
                                       lock_path=job.get("lock_path"), lock_timeout_s=120)
    ledger = ServingLedger(Storage(job["storage"]), registry.model_name)
    barrier = Path(job["barrier"])
    hold = (lambda: arrive(barrier, "apply", job["n"])) if job["hold"] else None
    serving = CountingServing(LedgerBackend(ledger, SETTINGS), hold)
    decision = decide(Candidate(summary(2.0), format_ok=True), None, None, POLICY)
    arrive(barrier, "ready", job["n"])
    try:
        result = promote(registry, serving, job["version"], decision,
                         actor=f"promoter-{job['version']}")
        outcome = {"action": result.action, "reasons": list(result.reasons)}
    except Exception as e:  # reported to the test, which counts it
        outcome = {"action": "error", "reasons": [f"{type(e).__name__}: {e}"]}
    outcome.update(version=job["version"], applied=serving.applied)
    Path(job["out"]).write_text(json.dumps(outcome))

