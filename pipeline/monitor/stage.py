"""The monitor's verdicts: what ``serving_acceptance`` and ``serving_drafter`` call after
summarising an RL step (:func:`.observed.observe_step`).

- :func:`check_reported` judges the drafter serving now on the speculative counters the RL
  engine reported with it, where promotions are not verified live.
- :func:`verify_promotion` judges a promotion just made on the live servers.

A verdict is recorded on the registry version (tags ``post_promotion.*``) and is final: a
``broken`` one rolls the promotion back first (:func:`pipeline.release.promotion.rollback`:
alias and serving, the reason recorded; the verdict is written only once that succeeded), a
``healthy`` one is not judged again (drift is the drift sensor's business). A version is
judged only while it is the drafter serving now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from pipeline.checks import serving_state
from pipeline.monitor.observed import observed_series
from pipeline.monitor.verify import (
    BROKEN,
    HEALTHY,
    UNDECIDED,
    Verification,
    VerifyPolicy,
    verify_live,
    verify_reported,
)
from pipeline.release.backend import ServingBackend
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import PromotionNotApplied, PromotionResult, rollback
from pipeline.storage import Storage

VERIFY_ACTOR = "aerie (post-promotion check)"
VERDICT_TAG = "post_promotion.verdict"


@dataclass(frozen=True)
class Checked:
    """A verdict (None: nothing serving, or judged already), the rollback it caused, and why
    a broken one was not rolled back (``note``: another drafter serves by then)."""

    verification: Verification | None
    rollback: PromotionResult | None = None
    note: str = ""


def check_reported(storage: Storage, name: str,
                   connect: Callable[[], tuple[DrafterRegistry, ServingBackend]],
                   policy: VerifyPolicy) -> Checked:
    """Judge the drafter serving ``name`` now on what the RL engine reported with it, unless
    it was judged already; ``connect`` gives the registry and serving backend (only called
    when a drafter serves)."""
    state = serving_state(storage, name)
    if state is None or not state.version:
        return Checked(None, note="no drafter serves: nothing to verify")
    registry, serving = connect()
    done = registry.get_version(state.version).tags.get(VERDICT_TAG)
    if done in (HEALTHY, BROKEN):
        return Checked(None, note=f"v{state.version} was verified already: {done}")
    if state.tau_at_promotion is None:
        return Checked(None, note=f"v{state.version} has no gated τ to compare with")
    verification = verify_reported(observed_series(storage, since=state.window_end),
                                   state.version, state.tau_at_promotion, policy)
    return _settle(registry, serving, verification)


def verify_promotion(storage: Storage, registry: DrafterRegistry, serving: ServingBackend,
                     step: int, version: str, urls: Sequence[str], policy: VerifyPolicy, *,
                     api_key: str | None = None) -> Checked:
    """Judge ``version``, promoted by the refresh of ``step``, on the servers at ``urls``."""
    return _settle(registry, serving, verify_live(storage, step, version, urls, policy,
                                                  api_key=api_key))


def _settle(registry: DrafterRegistry, serving: ServingBackend,
            verification: Verification) -> Checked:
    """Roll a broken promotion back, then record the decided verdict: a rollback that fails
    leaves no verdict, so the next attempt judges (and rolls back) again."""
    if verification.verdict == UNDECIDED:
        return Checked(verification)
    result, note = None, ""
    if verification.broken:
        try:
            result = rollback(registry, serving, actor=VERIFY_ACTOR,
                              expected=verification.version,
                              reason=f"post-promotion check: {verification.reason}")
        except PromotionNotApplied as e:  # another drafter serves by now: nothing to undo
            note = str(e)
    registry.set_tags(verification.version, {
        VERDICT_TAG: verification.verdict, "post_promotion.source": verification.source,
        "post_promotion.reason": verification.reason,
        "post_promotion.at": datetime.now(UTC).isoformat(timespec="seconds")})
    return Checked(verification, result, note)
