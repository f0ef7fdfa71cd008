"""Serving backends: how a promoted drafter reaches the servers that generate rollouts.

Every mode records what is served in the :class:`~pipeline.release.ledger.ServingLedger`;
modes differ in what else they do (their :class:`Actuator`, registered in
:mod:`pipeline.release.actuators`):

- ``manifest`` (default): nothing else. The manifest is the update; the RL trainer's
  rollout launcher reads it at weight sync (:func:`pipeline.serving_now.resolve_serving`)
  and (re)starts SGLang with its arguments.
- ``sglang-restart``: runs a configured command (:mod:`pipeline.release.restart`).
- ``vllm-restart``: the restart command, with vLLM's ``--speculative-config`` at hand.
- ``vllm-reload``: loads draft weights into running vLLM servers from disk
  (:mod:`pipeline.release.vllm_reload`).

Invariants:

- ``apply`` changes the ledger only after the actuator succeeded, so a failed update leaves
  the previous manifest current; if the ledger write fails after the actuator ran, the
  previous drafter is re-activated before the error propagates.
- ``restore(previous)`` makes ``previous`` (a manifest returned by ``current()`` earlier,
  or None for "no drafter") what is served again, as a new manifest that names it in
  ``restored_from``.
- Only committed drafters (a ``_manifest.json`` under the storage root) are served, so a
  reader can always fetch what a manifest names; actuators get local directories, and the
  ``manifest`` mode never downloads drafters.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from pipeline.algorithms import DEFAULT_ALGORITHM, serving_of
from pipeline.eagle3.spec import SpecParams
from pipeline.manifest import read_manifest
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import (
    Canary,
    ServingManifest,
    ServingTarget,
    canary_servers,
    materialize_drafter,
    serving_args,
)
from pipeline.storage import StorageError
from pipeline.verified import read_verified

log = logging.getLogger(__name__)


class ServingError(RuntimeError):
    """A serving update failed; the message says why. Worth another attempt (a server that is
    restarting, a hook that timed out): nothing moved."""


class ServingRefused(ServingError):
    """A serving update that another attempt cannot fix (the drafter is not servable, the
    mode cannot do what was asked); never retried."""


@runtime_checkable
class ServingBackend(Protocol):
    """What promotion needs from a serving mode."""

    mode: str

    def current(self) -> ServingManifest | None:
        """What is served now (None: nothing was ever published)."""
        ...

    def apply(self, target: ServingTarget, *, reason: str, token: int | None = None,
              details: dict[str, str] | None = None) -> ServingManifest:
        """Serve ``target`` (``details`` recorded with it); raise :class:`ServingError`
        (old drafter still served) if not.
        ``token``: the promotion lease's fencing token (see the ledger)."""
        ...

    def restore(self, previous: ServingManifest | None, *, reason: str,
                token: int | None = None, details: dict[str, str] | None = None
                ) -> ServingManifest:
        """Serve again what ``previous`` served (None or no target: no drafter)."""
        ...


class Actuator(Protocol):
    """The mode-specific part of a serving update, on local drafter directories."""

    mode: str
    compares_with_current: bool  # check() needs the served drafter's files too

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        """Refuse (raise :class:`ServingError`) before touching any server."""
        ...

    def activate(self, new_dir: Path | None, target: ServingTarget | None
                 ) -> dict[str, str]:
        """Make the servers run ``new_dir`` (None: no drafter); returns details to record."""
        ...

    # A mode that can serve a canary on part of its servers also has ``servers`` (the names
    # of the servers it addresses one by one) and ``on(servers)``: the same actuator on those
    # servers only. Without them, a canary is refused.


class LedgerBackend:
    """A serving backend: an optional :class:`Actuator` plus the ledger that records it."""

    def __init__(self, ledger: ServingLedger, settings: SpecParams,
                 actuator: Actuator | None = None, *, cache_dir: str | Path | None = None):
        if actuator is not None and cache_dir is None:
            raise ValueError("an actuator needs a cache_dir for local drafter copies")
        self.ledger = ledger
        self.settings = settings
        self.actuator = actuator
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.mode = actuator.mode if actuator is not None else "manifest"

    def __repr__(self) -> str:
        return f"LedgerBackend({self.mode!r}, {self.ledger!r})"

    def current(self) -> ServingManifest | None:
        return self.ledger.current()

    def apply(self, target: ServingTarget, *, reason: str, token: int | None = None,
              details: dict[str, str] | None = None) -> ServingManifest:
        return self._switch(target, reason=reason, restored_from=None, token=token,
                            details=details)

    def restore(self, previous: ServingManifest | None, *, reason: str,
                token: int | None = None, details: dict[str, str] | None = None
                ) -> ServingManifest:
        target = previous.target if previous is not None else None
        return self._switch(target, reason=reason,
                            restored_from=previous.sequence if previous else None, token=token,
                            details=details)

    def start_canary(self, target: ServingTarget, *, started_at: int, share: float = 0.0,
                     servers: tuple[str, ...] = (), reason: str, token: int | None = None
                     ) -> ServingManifest:
        """Serve ``target`` on part of the servers (``servers``, or a ``share`` of them)
        while the rest keep the champion; one canary at a time. A mode with an actuator
        names the servers it chose in the manifest; in ``manifest`` mode each launcher
        applies ``share`` to its own servers (:func:`~pipeline.serving_now.canary_servers`).
        Ending it is :meth:`apply` (the canary to every server) or :meth:`restore` of the
        champion (the canary's servers back to it)."""
        before = self.ledger.current()
        if token is not None:
            self.ledger.check_token(token, before)
        if before is not None and before.canary is not None:
            raise ServingRefused(f"serving {self.ledger.name}: canary "
                                 f"{before.canary.target.name} is in progress; one canary "
                                 f"at a time")
        algorithm, settings = self._served_as(target)
        canary = Canary(target, settings, serving_args(settings, algorithm=algorithm),
                        algorithm, started_at, tuple(servers), share)
        if self.actuator is not None:
            fleet = _servers_of(self.actuator)
            chosen = canary_servers(canary, fleet) if fleet else ()
            if not chosen:
                raise ServingRefused(
                    f"serving {self.ledger.name}: mode {self.mode} cannot serve a canary on "
                    + (f"part of its servers {list(fleet)} (servers {list(servers)}, share "
                       f"{share})" if fleet else "part of its servers (it addresses them all "
                       "at once)"))
            canary = replace(canary, servers=chosen, share=0.0)
        champion = before if before is not None and before.target is not None else None
        return self._publish(
            before, champion.target if champion else None, reason=reason, token=token,
            restored_from=None, canary=canary,
            served=(champion.algorithm, champion.settings) if champion
            else (DEFAULT_ALGORITHM, self.settings))

    def _switch(self, target: ServingTarget | None, *, reason: str,
                restored_from: int | None, token: int | None,
                details: dict[str, str] | None = None) -> ServingManifest:
        before = self.ledger.current()
        if token is not None:  # before the servers change, not only before the record does
            self.ledger.check_token(token, before)
        served = (DEFAULT_ALGORITHM, self.settings) if target is None else \
            self._served_as(target)
        return self._publish(before, target, reason=reason, token=token,
                             restored_from=restored_from, canary=None, served=served,
                             recorded=details)

    def _publish(self, before: ServingManifest | None, target: ServingTarget | None, *,
                 reason: str, token: int | None, restored_from: int | None,
                 canary: Canary | None, served: tuple[str, SpecParams],
                 recorded: dict[str, str] | None = None) -> ServingManifest:
        """Activate the change from ``before`` on the servers it concerns, then record it
        (with the caller's ``recorded`` details); a record that fails re-activates
        ``before``."""
        algorithm, settings = served
        details: dict[str, str] = dict(recorded or {})
        if self.actuator is not None:
            after = (target, canary)
            details |= self._activate(_layout(before, self.actuator),
                                      _layout_of(after, self.actuator), before, after)
        try:
            return self.ledger.publish(target, settings, mode=self.mode, reason=reason,
                                       restored_from=restored_from, details=details,
                                       token=token, algorithm=algorithm, canary=canary)
        except Exception as e:
            if self.actuator is not None:
                self._reactivate(before, (target, canary), e)
            raise ServingError(f"serving {self.ledger.name}: the update could not be "
                               f"recorded ({e}); the previous drafter was re-activated") from e

    def _activate(self, now: dict[str, ServingTarget | None],
                  then: dict[str, ServingTarget | None], before: ServingManifest | None,
                  after: tuple[ServingTarget | None, Canary | None]) -> dict[str, str]:
        """Hand each server what ``then`` says it serves. Without a canary before or after,
        every server gets the new drafter (as every update always did); with one, only the
        servers whose drafter changes, each group through the actuator of its servers."""
        involved = (before is not None and before.canary is not None) or \
            after[1] is not None
        groups: dict[tuple[str | None, str | None], list[str]] = {}
        for server, new in then.items():
            old = now.get(server)
            if involved and _same(old, new):
                continue
            groups.setdefault((_fp(old), _fp(new)), []).append(server)
        targets = {_fp(t): t for t in (*now.values(), *then.values())}
        fleet = set(then)
        details: dict[str, str] = {}
        for (old_fp, new_fp), servers in groups.items():
            actuator = self.actuator if set(servers) == fleet else \
                self.actuator.on(tuple(servers))
            new_target, old_target = targets[new_fp], targets[old_fp]
            new_dir = self._local(new_target)
            if new_dir is not None:
                current_dir = self._local(old_target) \
                    if actuator.compares_with_current else None
                actuator.check(new_dir, current_dir)
            done = actuator.activate(new_dir, new_target)
            details.update(done if len(groups) == 1 else
                           {f"{k} ({new_target.name if new_target else 'none'})": v
                            for k, v in done.items()})
        return details

    def _reactivate(self, before: ServingManifest | None,
                    after: tuple[ServingTarget | None, Canary | None],
                    error: Exception) -> None:
        try:
            self._activate(_layout_of(after, self.actuator), _layout(before, self.actuator),
                           before, after)
        except Exception as again:
            raise ServingError(f"serving {self.ledger.name}: recording the update failed "
                               f"({error}) and re-activating the previous drafter failed too "
                               f"({again}); servers may run an unrecorded drafter") from again

    def _served_as(self, target: ServingTarget) -> tuple[str, SpecParams]:
        """The algorithm of ``target`` and the settings it is served with, from its committed
        ``config.json``; a drafter that readers could not fetch (not committed under this
        storage's root) or that no algorithm claims is refused."""
        storage = self.ledger.storage
        try:
            key = storage.key_of(target.drafter_uri)
            committed = read_manifest(storage, key)
        except (StorageError, ValueError) as e:
            raise ServingRefused(f"drafter {target.drafter_uri} cannot be served: {e}") from e
        if committed is None:
            raise ServingRefused(f"drafter {target.drafter_uri} has no committed manifest; "
                                 f"readers could not fetch it")
        try:
            config = json.loads(read_verified(storage, key, committed, "config.json"))
            algorithm, settings = serving_of(config, self.settings, target.drafter_uri)
        except (StorageError, ValueError, KeyError) as e:  # UnknownAlgorithmError too
            raise ServingRefused(f"drafter {target.drafter_uri} cannot be served: {e}") from e
        return algorithm.name, settings

    def _local(self, target: ServingTarget | None) -> Path | None:
        if target is None:
            return None
        return materialize_drafter(self.ledger.storage, target.drafter_uri, self.cache_dir,
                                   fingerprint=target.fingerprint)


ALL = "*"  # the one "server" of an actuator that addresses all of them at once


def _servers_of(actuator: Actuator) -> tuple[str, ...]:
    """The servers an actuator can address one by one (``servers``; () when it cannot)."""
    return tuple(getattr(actuator, "servers", ()) or ())


def _layout_of(state: tuple[ServingTarget | None, Canary | None], actuator: Actuator
               ) -> dict[str, ServingTarget | None]:
    """Which drafter each server runs in ``state`` (target, canary)."""
    target, canary = state
    fleet = _servers_of(actuator) or (ALL,)
    on_canary = set(canary_servers(canary, fleet)) if canary is not None else set()
    return {s: canary.target if s in on_canary else target for s in fleet}


def _layout(manifest: ServingManifest | None, actuator: Actuator
            ) -> dict[str, ServingTarget | None]:
    if manifest is None:
        return _layout_of((None, None), actuator)
    return _layout_of((manifest.target, manifest.canary), actuator)


def _fp(target: ServingTarget | None) -> str | None:
    return target.fingerprint if target is not None else None


def _same(a: ServingTarget | None, b: ServingTarget | None) -> bool:
    return _fp(a) == _fp(b)
