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
from pathlib import Path
from typing import Protocol, runtime_checkable

from pipeline.algorithms import DEFAULT_ALGORITHM, serving_of
from pipeline.eagle3.spec import SpecParams
from pipeline.manifest import read_manifest
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import ServingManifest, ServingTarget, materialize_drafter
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

    def apply(self, target: ServingTarget, *, reason: str, token: int | None = None
              ) -> ServingManifest:
        """Serve ``target``; raise :class:`ServingError` (old drafter still served) if not.
        ``token``: the promotion lease's fencing token (see the ledger)."""
        ...

    def restore(self, previous: ServingManifest | None, *, reason: str,
                token: int | None = None) -> ServingManifest:
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

    def apply(self, target: ServingTarget, *, reason: str, token: int | None = None
              ) -> ServingManifest:
        return self._switch(target, reason=reason, restored_from=None, token=token)

    def restore(self, previous: ServingManifest | None, *, reason: str,
                token: int | None = None) -> ServingManifest:
        target = previous.target if previous is not None else None
        return self._switch(target, reason=reason,
                            restored_from=previous.sequence if previous else None, token=token)

    def _switch(self, target: ServingTarget | None, *, reason: str,
                restored_from: int | None, token: int | None) -> ServingManifest:
        before = self.ledger.current()
        if token is not None:  # before the servers change, not only before the record does
            self.ledger.check_token(token, before)
        algorithm, settings = DEFAULT_ALGORITHM, self.settings
        if target is not None:
            algorithm, settings = self._served_as(target)
        details: dict[str, str] = {}
        if self.actuator is not None:
            new_dir = self._local(target)
            if new_dir is not None:
                current_dir = self._local(before.target if before else None) \
                    if self.actuator.compares_with_current else None
                self.actuator.check(new_dir, current_dir)
            details = self.actuator.activate(new_dir, target)
        try:
            return self.ledger.publish(target, settings, mode=self.mode, reason=reason,
                                       restored_from=restored_from, details=details,
                                       token=token, algorithm=algorithm)
        except Exception as e:
            if self.actuator is not None:
                self._reactivate(before, e)
            raise ServingError(f"serving {self.ledger.name}: the update could not be "
                               f"recorded ({e}); the previous drafter was re-activated") from e

    def _reactivate(self, before: ServingManifest | None, error: Exception) -> None:
        target = before.target if before else None
        try:
            self.actuator.activate(self._local(target), target)
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
