"""The monitor's verdicts: what ``serving_acceptance`` and ``serving_drafter`` call after
summarising an RL step (:func:`.observed.observe_step`).

- :func:`check_reported` judges the drafter serving now on the speculative counters the RL
  engine reported with it, where promotions are not verified live.
- :func:`verify_promotion` judges a promotion just made on the live servers;
  :func:`after_promotion` decides, for ``serving_drafter``, whether and how a promotion is
  verified, and what the promotion and its ``promotion_verified`` check then say.
- :func:`outcome_of` is the ``promotion_verified`` outcome of any verdict.
- :func:`settle_canary` judges a canary serving part of the servers
  (:func:`.canary.judge_canary`) and, once decided, promotes it to every server or rolls it
  back (:func:`pipeline.release.canary.conclude_canary`). A promoted canary's
  post-promotion verdict is reached on its canary rollouts at once (they are what it served
  after promotion would have served); a rolled-back one gets none (it was never champion).

A verdict is recorded on the registry version (tags ``post_promotion.*``) and is final: a
``broken`` one rolls the promotion back first (:func:`pipeline.release.promotion.rollback`:
alias and serving, the reason recorded; the verdict is written only once that succeeded), a
``healthy`` one is not judged again (drift is the drift sensor's business). A version is
judged only while it is the drafter serving now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Literal

from pipeline.checks import CheckOutcome, serving_state
from pipeline.monitor.canary import PROMOTE, WAIT, CanaryPolicy, CanaryVerdict, judge_canary
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
from pipeline.release.canary import conclude_canary
from pipeline.release.lineage import read_lineage
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.release.promotion import PromotionNotApplied, PromotionResult, rollback
from pipeline.serving_now import read_serving
from pipeline.storage import Storage

VERIFY_ACTOR = "aerie (post-promotion check)"
CANARY_ACTOR = "aerie (canary)"
VERDICT_TAG = "post_promotion.verdict"
EVIDENCE_TAG = "post_promotion.evidence"  # JSON {source, reason, at} of the verdict


# called with the verdict and the rollback's result while the promotion lock is held
OnRollback = Callable[[Verification, PromotionResult], None]


@dataclass(frozen=True)
class Checked:
    """A verdict (None: nothing serving, or judged already), the rollback it caused, and why
    a broken one was not rolled back (``note``: another drafter serves by then)."""

    verification: Verification | None
    rollback: PromotionResult | None = None
    note: str = ""


@dataclass(frozen=True)
class AfterPromotion:
    """A promotion as it stands after its check (action ``rolled_back``, and the champion
    after the rollback, when the check found it broken), the check's outcome, and the verdict
    reached now (None when none was: nothing new promoted, judged already, or judged later)."""

    promotion: PromotionResult
    outcome: CheckOutcome
    verification: Verification | None = None


def after_promotion(storage: Storage, registry: DrafterRegistry, p: PromotionResult, step: int,
                    *, verify: Literal["live", "reported", "off"],
                    serving: Callable[[], ServingBackend],
                    urls: Sequence[str], policy: VerifyPolicy,
                    api_key: str | None = None) -> AfterPromotion:
    """Verify the promotion ``p`` the refresh of ``step`` just made (or a re-run's champion
    without a verdict yet, e.g. after a probe that could not reach the servers).

    ``verify`` says how promotions are verified: ``"live"`` (on the servers at ``urls``, now;
    ``serving()`` gives the backend a rollback goes through), ``"reported"`` (later, from
    the counters the RL engine reports: :func:`check_reported`) or ``"off"``."""
    if p.action not in ("promoted", "already_champion"):
        return AfterPromotion(p, CheckOutcome(None, f"{p.action}: no new drafter to verify"))
    verdict = registry.get_version(p.version).tags.get(VERDICT_TAG)
    if verdict is not None:  # a re-run: judged when it was promoted
        return AfterPromotion(p, CheckOutcome(verdict != BROKEN,
                                              f"v{p.version} was verified already: {verdict}"))
    if verify != "live":
        how = "off (AERIE_SERVING_VERIFY)" if verify == "off" else (
            "from the acceptance the RL engine reports in the next RL steps "
            "(serving_acceptance reports this check's result)")
        return AfterPromotion(p, CheckOutcome(None, f"v{p.version}: verification {how}"))
    checked = verify_promotion(storage, registry, serving(), step, p.version, urls, policy,
                               api_key=api_key)
    back = checked.rollback
    if back is None:
        return AfterPromotion(p, outcome_of(checked), checked.verification)
    rolled = PromotionResult("rolled_back", p.model, back.version, p.version, back.serving,
                             (*p.reasons, *back.reasons))
    return AfterPromotion(rolled, outcome_of(checked), checked.verification)


def outcome_of(checked: Checked) -> CheckOutcome:
    """The ``promotion_verified`` outcome of a verdict: fails for a broken drafter, saying
    whether it was rolled back (and to what) or why not; not established (None) while no
    verdict is reached (undecided, or nothing to judge)."""
    v = checked.verification
    if v is None:
        return CheckOutcome(None, checked.note)
    if v.verdict == UNDECIDED:
        return CheckOutcome(None, f"v{v.version} pending: {v.reason}", v.metadata())
    if checked.rollback is not None:
        to = checked.rollback.version
        return CheckOutcome(False, f"v{v.version} broken after promotion: {v.reason}; rolled "
                                   f"back to {'v' + to if to else 'no drafter'}",
                            v.metadata() | {"rolled_back_to": to or "none"})
    return CheckOutcome(not v.broken, f"v{v.version} {v.verdict}: {v.reason}"
                        + (f"; not rolled back: {checked.note}" if checked.note else ""),
                        v.metadata())


def check_reported(storage: Storage, name: str,
                   connect: Callable[[], tuple[DrafterRegistry, ServingBackend]],
                   policy: VerifyPolicy, *,
                   on_rollback: OnRollback | None = None) -> Checked:
    """Judge the drafter serving ``name`` now on what the RL engine reported with it, unless
    it was judged already; ``connect`` gives the registry and serving backend (only called
    when a drafter serves). ``on_rollback(verification, result)`` runs while the rollback
    still holds the promotion lock (see :func:`_settle`)."""
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
    return _settle(registry, serving, verification, on_rollback)


def verify_promotion(storage: Storage, registry: DrafterRegistry, serving: ServingBackend,
                     step: int, version: str, urls: Sequence[str], policy: VerifyPolicy, *,
                     api_key: str | None = None) -> Checked:
    """Judge ``version``, promoted by the refresh of ``step``, on the servers at ``urls``."""
    return _settle(registry, serving, verify_live(storage, step, version, urls, policy,
                                                  api_key=api_key))


def _settle(registry: DrafterRegistry, serving: ServingBackend, verification: Verification,
            on_rollback: OnRollback | None = None) -> Checked:
    """Roll a broken promotion back, then record the decided verdict: a rollback that fails
    leaves no verdict, so the next attempt judges (and rolls back) again. The rollback takes
    the promotion lock, as every change of champion does; ``on_rollback`` runs inside it
    (a caller outside the promotion pool records the change there)."""
    if verification.verdict == UNDECIDED:
        return Checked(verification)

    def record_verdict() -> None:
        registry.set_tags(verification.version, {
            VERDICT_TAG: verification.verdict, EVIDENCE_TAG: {
                "source": verification.source, "reason": verification.reason,
                "at": datetime.now(UTC).isoformat(timespec="seconds")}})

    def rolled_back(result: PromotionResult) -> None:  # the verdict first: a follow-up
        record_verdict()                                # that fails cannot lose it
        if on_rollback is not None:
            on_rollback(verification, result)

    if not verification.broken:
        record_verdict()
        return Checked(verification)
    try:
        result = rollback(registry, serving, actor=VERIFY_ACTOR, expected=verification.version,
                          reason=f"post-promotion check: {verification.reason}",
                          on_applied=rolled_back)
    except PromotionNotApplied as e:  # another drafter serves by now: nothing to undo
        record_verdict()
        return Checked(verification, None, str(e))
    return Checked(verification, result)


@dataclass(frozen=True)
class CanaryCheck:
    """A canary's verdict now (None: no canary serves), the change it made (the canary
    promoted, or rolled back), the promoted canary's post-promotion verdict, and why a
    decided canary was not concluded (``note``)."""

    verdict: CanaryVerdict | None
    result: PromotionResult | None = None
    verified: Checked | None = None  # the promoted canary's post-promotion check
    note: str = ""


def settle_canary(storage: Storage, name: str,
                  connect: Callable[[], tuple[DrafterRegistry, ServingBackend]],
                  policy: CanaryPolicy, verify_policy: VerifyPolicy, *,
                  on_applied: Callable[[CanaryVerdict, PromotionResult], None] | None = None
                  ) -> CanaryCheck:
    """Judge the canary serving ``name`` on the RL steps since it started and act on a
    decided verdict; ``connect`` is called only then. ``on_applied(verdict, result)`` runs
    under the promotion lock."""
    manifest = read_serving(storage, name)
    canary = manifest.canary if manifest is not None else None
    if canary is None:
        return CanaryCheck(None, note="no canary serves")
    candidate = canary.target.registry_version
    champion = manifest.target.registry_version if manifest.target else "none"
    series = observed_series(storage, since=canary.started_at)
    verdict = judge_canary(series, candidate, champion, canary.started_at, policy)
    if verdict.action == WAIT:
        return CanaryCheck(verdict)
    registry, serving = connect()
    evidence = asdict(verdict.evidence) if verdict.evidence else {}
    try:
        result = conclude_canary(
            registry, serving, candidate, verdict.action == PROMOTE, verdict.reason,
            evidence, actor=CANARY_ACTOR,
            on_applied=(lambda r: on_applied(verdict, r)) if on_applied else None)
    except PromotionNotApplied as e:  # another change came first: nothing to conclude
        return CanaryCheck(verdict, note=str(e))
    if verdict.action != PROMOTE:
        return CanaryCheck(verdict, result)
    gated = read_lineage(registry.get_version(candidate).tags).get("tau")
    if not isinstance(gated, int | float):
        return CanaryCheck(verdict, result, note=f"v{candidate} has no gated τ to verify "
                                                 f"against")
    checked = _settle(registry, serving, verify_reported(series, candidate, float(gated),
                                                         verify_policy))
    return CanaryCheck(verdict, result, checked)
