"""Promotion, manual override and rollback: move alias ``champion`` and the servers together.

Three entry points, each a separately named function (no flag bypasses the gate):

- :func:`promote` acts on a gate :class:`~pipeline.release.gate.Decision`. A refusal only
  records its reasons as tags on the candidate; nothing else moves. A candidate that is the
  drafter serving now (same fingerprint as the serving record's) is ``already_champion``:
  nothing is recorded, promoted or restarted, whatever the decision says.
- :func:`force_promote` is the manual override: no gate, but ``actor`` and ``reason`` are
  required and recorded.
- :func:`rollback` makes the current champion's recorded ``previous_champion`` the champion
  again (or "no drafter" when there was none).

Invariants:

- The champion is what the serving record serves (:func:`serving_champion`, the record warm
  start and evaluation read); alias ``champion`` must agree or promotion refuses.
- Serialised: the read-champion → update-serving → move-alias sequence runs under the
  registry's promotion lock (or the lock passed in), because alias moves are last-writer-
  wins. The alias is read back after the move. Under the cross-host lease
  (:mod:`pipeline.release.lease`) every write is fenced: a promoter that lost the lease
  writes nothing more; the serving manifest and the champion's ``promotion_token`` tag
  carry the token.
- All or nothing: tags describing the switch are written first (they move nothing); then
  the serving update — if it fails, neither the alias nor the servers changed; then the alias
  move — if it or its read-back fails, the serving update is undone (the previous manifest
  restored, only while this promotion's manifest is still current) and
  :class:`PromotionError` is raised.
- A decision made against another champion than the current one is stale and refused.
- The champion's ``previous_champion`` tag (a version, or ``none``) is the rollback chain.
- Every decision is kept as its own ``gate.<n>`` tag (who, when, why, against which
  champion, in which run; written before the switch, never rewritten; a failed switch adds
  ``gate.<n>.error``); the standing ``gate.decision`` moves
  to a promotion only after the switch succeeded, and a refusal never replaces a promotion
  (:meth:`~pipeline.release.mlflow_registry.DrafterRegistry.set_standing`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.release.backend import ServingBackend
from pipeline.release.decisions import FORCED, PROMOTED, REFUSED, DecisionRecord
from pipeline.release.gate import ALREADY_CHAMPION, Decision
from pipeline.release.lease import fenced
from pipeline.release.lineage import MAX_TAG_VALUE
from pipeline.release.mlflow_registry import CHAMPION, DrafterRegistry, DrafterVersion
from pipeline.serving_now import ServingManifest, ServingTarget

log = logging.getLogger(__name__)

NONE = "none"
PREVIOUS_CHAMPION = "previous_champion"
ROLLED_BACK = "rolled_back"  # JSON {at, by, reason, run_id}: the version's newest rollback
RECONCILED = "reconciled"  # JSON {at, by, reason}: the alias moved back to the served version


class PromotionError(RuntimeError):
    """A promotion or rollback failed; the message says what state was left behind."""


class PromotionNotApplied(PromotionError):
    """A promotion that failed with nothing moved (serving and the alias as before): safe to
    try again; whether that can help depends on its cause."""


@dataclass(frozen=True)
class PromotionResult:
    """What happened. ``action``: promoted | forced | rolled_back | refused |
    already_champion (the candidate is served already: nothing moved or was recorded)."""

    action: str
    model: str
    version: str | None  # the champion after the call (the candidate, if refused)
    previous_champion: str | None
    serving: ServingManifest | None
    reasons: tuple[str, ...]

    @property
    def moved(self) -> bool:
        return self.action in ("promoted", "forced", "rolled_back")


def serving_target(version: DrafterVersion) -> ServingTarget:
    """What to serve for a registered version (its ``drafter_uri`` lineage tag)."""
    if not version.drafter_uri or not version.fingerprint:
        raise PromotionError(f"{version.model} v{version.version} lacks the drafter_uri or "
                             f"fingerprint tag; it cannot be served")
    return ServingTarget(drafter_uri=version.drafter_uri, fingerprint=version.fingerprint,
                         registry_model=version.model, registry_version=version.version,
                         registry_source=f"models:/{version.model}/{version.version}")


def promote(registry: DrafterRegistry, serving: ServingBackend, candidate_version: str,
            decision: Decision, *, actor: str = "aerie", dagster_run_id: str | None = None,
            lock: AbstractContextManager[Any] | None = None) -> PromotionResult:
    """Make ``candidate_version`` the champion if ``decision`` says so (see module doc)."""
    candidate_version = str(candidate_version)
    with held(registry, serving, lock) as (registry, serving):
        refused, current = screen(registry, serving, candidate_version, decision, actor,
                                  dagster_run_id)
        if refused is not None:
            return refused
        record = DecisionRecord(PROMOTED, decision.reasons, actor, now(), decision.baseline,
                                decision.relative_gain, current, dagster_run_id)
        manifest = make_champion(registry, serving, candidate_version,
                                  {PREVIOUS_CHAMPION: current or NONE},
                                  reason=f"promoted v{candidate_version} by the gate: "
                                  f"{decision.reasons[0]}", decision=record)
        return PromotionResult("promoted", registry.model_name, candidate_version, current,
                               manifest, decision.reasons)


def screen(registry: DrafterRegistry, serving: ServingBackend, candidate_version: str,
           decision: Decision, actor: str, dagster_run_id: str | None
           ) -> tuple[PromotionResult | None, str | None]:
    """What a gate decision must pass before anything serves the candidate, under the
    promotion lock: ``(result, None)`` when it stops here (already champion, a stale or
    refusing decision: the refusal recorded), else ``(None, the champion)``."""
    served = _served_target(registry, serving)
    candidate = registry.get_version(candidate_version)
    if served is not None and _is_served(candidate, served):  # e.g. a re-run
        return _already_champion(registry, serving, candidate, served), None
    if decision.verdict == ALREADY_CHAMPION:
        return refuse(registry, serving, candidate_version, decision, actor,
                       dagster_run_id, served, (
                           f"stale decision: made when the candidate was champion "
                           f"v{decision.champion_version}, but the serving record serves "
                           f"{_v(served.registry_version if served else None)} now; "
                           f"evaluate again",)), None
    if not decision.promote:
        return refuse(registry, serving, candidate_version, decision, actor,
                       dagster_run_id, served, decision.reasons), None
    current = serving_champion(registry, serving)
    stale = _staleness(decision, current)
    if stale:
        return refuse(registry, serving, candidate_version, decision, actor,
                       dagster_run_id, served, (stale,)), None
    return None, current


def force_promote(registry: DrafterRegistry, serving: ServingBackend, candidate_version: str,
                  *, actor: str, reason: str, dagster_run_id: str | None = None,
                  lock: AbstractContextManager[Any] | None = None) -> PromotionResult:
    """The manual override: make ``candidate_version`` champion without the gate, recording
    who did it and why."""
    candidate_version = str(candidate_version)
    if not actor.strip() or not reason.strip():
        raise ValueError("force_promote needs a non-empty actor and reason")
    with held(registry, serving, lock) as (registry, serving):
        _require_version(registry, candidate_version)
        current = serving_champion(registry, serving, reconcile=True)
        if current == candidate_version:  # served already: at most the alias lags behind
            alias = registry.alias(CHAMPION)
            if alias == current:
                return PromotionResult(ALREADY_CHAMPION, registry.model_name, current,
                                       current, serving.current(),
                                       (f"v{current} is the champion already",))
            why = (f"alias {CHAMPION} moved from {_v(alias)} to the served v{current} by "
                   f"{actor}: {reason}")
            registry.set_tags(current, {RECONCILED: {"at": now(), "by": actor,
                                                     "reason": reason}})
            registry.set_alias(CHAMPION, current)  # previous_champion stays as it was
            return PromotionResult("forced", registry.model_name, current, alias,
                                   serving.current(), (why,))
        record = DecisionRecord(FORCED, (f"forced by {actor}: {reason}",), actor, now(),
                                "override", math.nan, current, dagster_run_id)
        manifest = make_champion(registry, serving, candidate_version,
                                  {PREVIOUS_CHAMPION: current or NONE},
                                  reason=f"force v{candidate_version} by {actor}: {reason}",
                                  decision=record)
        return PromotionResult("forced", registry.model_name, candidate_version, current,
                               manifest, (f"forced by {actor}: {reason}",))


@contextmanager
def held(registry: DrafterRegistry, serving: ServingBackend,
          lock: AbstractContextManager[Any] | None
          ) -> Iterator[tuple[DrafterRegistry, ServingBackend]]:
    """Hold ``lock`` (default: the registry's promotion lock) and give the registry and the
    serving backend to write through: under a lease, fenced views (each write checks the
    lease first; serving writes carry its token); under a one-host lock, themselves."""
    with lock if lock is not None else registry.promotion_lock() as held:
        if getattr(held, "token", None) is None:
            yield registry, serving
        else:
            yield (registry.fenced_by(held),
                   fenced(serving, held, ("apply", "restore", "start_canary"),
                          token=held.token))


def _require_version(registry: DrafterRegistry, version: str) -> None:
    """Refuse a version that was never registered, listing the ones that were."""
    known = registry.version_numbers()
    if version not in known:
        listed = ", ".join(known) if known else ("none yet (a refresh registers one: aerie "
                                                  "demo, or the drafter_refresh job)")
        raise PromotionError(f"{registry.model_name} has no version {version}; registered "
                             f"versions: {listed}")


def rollback(registry: DrafterRegistry, serving: ServingBackend, *, actor: str = "aerie",
             reason: str = "rollback", dagster_run_id: str | None = None,
             lock: AbstractContextManager[Any] | None = None,
             expected: str | None = None,
             on_applied: Callable[[PromotionResult], None] | None = None) -> PromotionResult:
    """Restore the champion before the current one (alias and serving); ``expected``: only
    if that one is this version (a check judged it), else :class:`PromotionNotApplied`.
    ``on_applied(result)`` runs while the promotion lock is still held (a caller outside
    the promotion pool records the change there, so no promotion's record can come
    between)."""
    with held(registry, serving, lock) as (registry, serving):
        result = _rollback(registry, serving, actor, reason, dagster_run_id, expected)
        if on_applied is not None:
            on_applied(result)
        return result


def _rollback(registry: DrafterRegistry, serving: ServingBackend, actor: str, reason: str,
              dagster_run_id: str | None, expected: str | None) -> PromotionResult:
    serving_version = serving_champion(registry, serving)
    if expected is not None and serving_version != expected:
        raise PromotionNotApplied(f"{registry.model_name}: v{expected} is no longer the "
                                  f"champion ({_v(serving_version)} is); not rolled back")
    if serving_version is None:
        raise PromotionError(f"{registry.model_name} has no champion to roll back: no "
                             f"drafter was promoted yet (a refresh promotes the first one "
                             f"that beats no drafter: aerie demo, or the drafter_refresh "
                             f"job)")
    current = registry.get_version(serving_version)
    previous = current.tags.get(PREVIOUS_CHAMPION)
    if previous is None:
        raise PromotionError(f"{registry.model_name} v{current.version} has no "
                             f"{PREVIOUS_CHAMPION} tag; nothing to roll back to")
    registry.set_tags(current.version, {ROLLED_BACK: {
        "at": now(), "by": actor, "reason": reason,
        **({"run_id": dagster_run_id} if dagster_run_id else {})}})
    why = f"rollback v{current.version} -> {previous} by {actor}: {reason}"
    if previous == NONE:
        manifest = _clear_champion(registry, serving, reason=why)
        return PromotionResult("rolled_back", registry.model_name, None, current.version,
                               manifest, (why,))
    manifest = make_champion(registry, serving, previous, {}, reason=why)
    return PromotionResult("rolled_back", registry.model_name, previous, current.version,
                           manifest, (why,))


def serving_champion(registry: DrafterRegistry, serving: ServingBackend, *,
                     reconcile: bool = False) -> str | None:
    """The champion version by the serving record (the one record of "the drafter serving
    now" that warm start and evaluation read too). Alias ``champion`` must agree; when it
    does not, promotion and rollback refuse, and only a forced promotion (``reconcile``)
    goes on, rewriting both."""
    target = _served_target(registry, serving)
    version = target.registry_version if target else None
    alias = registry.alias(CHAMPION)
    if alias != version and not reconcile:
        raise PromotionError(
            f"{registry.model_name}: the serving record serves {_v(version)} but alias "
            f"{CHAMPION} is {_v(alias)}; reconcile with promote_drafter_manually")
    return version


def _served_target(registry: DrafterRegistry, serving: ServingBackend) -> ServingTarget | None:
    """The drafter the serving record serves now (None: no drafter); it must be a version
    of ``registry``'s model."""
    manifest = serving.current()
    target = manifest.target if manifest else None
    if target is not None and target.registry_model != registry.model_name:
        raise PromotionError(f"the serving record serves {target.registry_model} "
                             f"v{target.registry_version}, not a version of "
                             f"{registry.model_name}")
    return target


def _is_served(candidate: DrafterVersion, served: ServingTarget) -> bool:
    """The candidate is the drafter ``served``: its fingerprint (or its version)."""
    return served.registry_version == candidate.version or (
        candidate.fingerprint is not None and candidate.fingerprint == served.fingerprint)


def _already_champion(registry: DrafterRegistry, serving: ServingBackend,
                      candidate: DrafterVersion, served: ServingTarget) -> PromotionResult:
    manifest = serving.current()
    same = "is" if served.registry_version == candidate.version else \
        f"has the fingerprint of v{served.registry_version}, which is"
    why = (f"v{candidate.version} ({served.fingerprint[:12]}) {same} the drafter serving now "
           f"(serving manifest {manifest.sequence}); nothing promoted, restarted or recorded")
    log.info("%s: %s", registry.model_name, why)
    return PromotionResult(ALREADY_CHAMPION, registry.model_name, served.registry_version,
                           served.registry_version, manifest, (why,))


def refuse(registry: DrafterRegistry, serving: ServingBackend, version: str,
            decision: Decision, actor: str, dagster_run_id: str | None,
            served: ServingTarget | None, reasons: tuple[str, ...]) -> PromotionResult:
    """Record a refusal of ``version`` (its own decision tags; the standing only if the
    version was never promoted); nothing else moves."""
    champion = served.registry_version if served else None
    n = registry.record_decision(version, DecisionRecord(
        REFUSED, reasons, actor, now(), decision.baseline, decision.relative_gain, champion,
        dagster_run_id))
    registry.set_standing(version, n)
    log.info("%s v%s refused: %s", registry.model_name, version, "; ".join(reasons))
    return PromotionResult("refused", registry.model_name, version, champion,
                           serving.current(), reasons)


def _v(version: str | None) -> str:
    return f"v{version}" if version else "no drafter"


def make_champion(registry: DrafterRegistry, serving: ServingBackend, version: str,
                   tags: Mapping[str, Any], *, reason: str,
                   decision: DecisionRecord | None = None,
                   details: dict[str, str] | None = None) -> ServingManifest:
    """Tags (``decision`` as the version's next decision), then serving, then the alias
    (read back); undo serving if the alias fails. The decision becomes the version's
    standing once the switch succeeded."""
    new = registry.get_version(version)
    target = serving_target(new)
    decision_id = registry.record_decision(version, decision) if decision else None
    if registry.fence_token is not None:
        tags = {**tags, "promotion_token": registry.fence_token}
    if tags:
        registry.set_tags(version, tags)
    before = serving.current()
    try:
        manifest = serving.apply(target, reason=reason, details=details)
    except Exception as e:
        _best_effort_tag(registry, version, f"serving update failed: {e}", decision_id)
        raise PromotionNotApplied(f"{registry.model_name} v{version}: serving update "
                                  f"failed, nothing moved: {e}") from e
    _move_alias(registry, serving, version, before, manifest, decision_id)
    log.info("%s: champion is now v%s (%s)", registry.model_name, version, reason)
    if decision_id is not None:
        try:
            registry.set_standing(version, decision_id)
        except Exception as e:
            raise PromotionError(f"{registry.model_name} v{version} is champion and served, "
                                 f"but its gate.decision could not be set to decision "
                                 f"{decision_id}: {e}") from e
    return manifest


def _clear_champion(registry: DrafterRegistry, serving: ServingBackend, *, reason: str
                    ) -> ServingManifest:
    before = serving.current()
    try:
        manifest = serving.restore(None, reason=reason)
    except Exception as e:
        raise PromotionNotApplied(f"{registry.model_name}: serving without a drafter "
                                  f"failed, nothing moved: {e}") from e
    _move_alias(registry, serving, None, before, manifest)
    return manifest


def _move_alias(registry: DrafterRegistry, serving: ServingBackend, version: str | None,
                before: ServingManifest | None, written: ServingManifest,
                decision_id: int | None = None) -> None:
    """Move alias ``champion`` to ``version`` (None: remove it) and read it back; if that
    fails, undo exactly this promotion's serving update (``written``, back to ``before``).
    A move the registry accepted but that cannot be read back is not undone: the alias has
    most likely moved, and undoing serving would split the two."""
    error: Exception | None = None
    readback: str | None = "unread"
    try:
        if version is None:
            registry.delete_alias(CHAMPION)
        else:
            registry.set_alias(CHAMPION, version)
    except Exception as e:
        error = e
    try:
        readback = registry.alias(CHAMPION)
    except Exception as e:
        if error is None:
            raise PromotionError(
                f"{registry.model_name}: the registry accepted moving {CHAMPION} to "
                f"{_v(version)} but reading it back failed ({e}); serving serves "
                f"{_v(version)} (manifest {written.sequence}). Check the alias; "
                f"promote_drafter_manually reconciles it if it did not move") from e
        error = error or e
    if readback == version:
        if error is not None:
            log.warning("%s: alias call raised (%s) but the read-back shows v%s",
                        registry.model_name, error, version)
        return
    problem = f"{error}" if error is not None else f"read back {readback!r}"
    try:
        _undo(serving, written, before, reason=f"undo: moving {CHAMPION} to {version} failed")
    except Exception as undo:
        raise PromotionError(
            f"{registry.model_name}: moving {CHAMPION} to {version} failed ({problem}) AND "
            f"restoring the previous serving manifest failed ({undo}); servers may run a "
            f"drafter that is not the champion") from undo
    if version is not None:
        _best_effort_tag(registry, version, f"alias move failed: {problem}", decision_id)
    raise PromotionNotApplied(f"{registry.model_name}: moving {CHAMPION} to {version} "
                              f"failed ({problem}); the serving update was undone") from error


def _undo(serving: ServingBackend, written: ServingManifest, before: ServingManifest | None, *,
          reason: str) -> None:
    """Serve ``before`` again, only while ``written`` is still what is served: an undo never
    overwrites someone else's update."""
    now = serving.current()
    if now is None or now.sequence != written.sequence:
        raise PromotionError(f"serving moved on from this promotion's manifest "
                             f"{written.sequence} to {now.sequence if now else 'nothing'}")
    serving.restore(before, reason=reason)


def _staleness(decision: Decision, champion: str | None) -> str | None:
    """Why ``decision`` no longer applies to the registry's ``champion``, if it doesn't."""
    if decision.baseline == "no-drafter" and champion is not None:
        return (f"stale decision: made against no drafter, but v{champion} became champion "
                f"since; evaluate again")
    if decision.baseline == "champion" and decision.champion_version is not None \
            and decision.champion_version != champion:
        return (f"stale decision: made against champion v{decision.champion_version}, but "
                f"the champion is now {champion}; evaluate again")
    return None


def _best_effort_tag(registry: DrafterRegistry, version: str, error: str,
                     decision_id: int | None = None) -> None:
    """``promotion.error`` (the newest failure) and the decision's own ``gate.<n>.error``."""
    tags = {"promotion.error": error[:MAX_TAG_VALUE]}
    if decision_id is not None:
        tags[f"gate.{decision_id}.error"] = error[:MAX_TAG_VALUE]
    try:
        registry.set_tags(version, tags)
    except Exception as e:  # noqa: BLE001 - the original failure is what gets raised
        log.warning("could not tag v%s with its promotion error: %s", version, e)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
