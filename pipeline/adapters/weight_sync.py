"""The drafter back at an RL trainer's weight sync.

Promotion records the drafter to serve in the serving manifest (:mod:`pipeline.serving_now`);
an RL trainer launches its rollout engines with the drafter current at launch and then
pushes only policy weights. :class:`DrafterSync` is what a framework's sync point calls
(verl's ``CheckpointEngineManager.update_weights``, slime's post-write hook, a TRL or
NeMo-RL launcher between runs): when the manifest has moved since the last call it fetches
the new drafter (verified against its fingerprint) and hands it to the engines through one
of the serving actuators, a restart command (:class:`~pipeline.release.restart.RestartHook`)
or an in-place draft reload (:class:`~pipeline.release.vllm_reload.VllmDraftReload`). With
no actuator it only fetches, for a launcher that reads :attr:`DrafterSync.launch`.

Configured from the environment by :func:`sync_from_env` (the hooks run inside trainer
processes, not Dagster):

- ``AERIE_STORAGE_URL``, ``AERIE_SERVING_NAME`` (the registered model, e.g.
  ``aerie-drafter-llama``): which manifest;
- ``AERIE_SYNC_MODE``: ``fetch`` (default; the engines are unchanged), ``vllm-reload``,
  ``vllm-restart`` or ``sglang-restart`` (or a framework's own, e.g. verl's
  ``verl-replicas``); ``AERIE_SYNC_SERVER_URLS`` (comma-separated, ``vllm-reload``) or
  ``AERIE_SYNC_RESTART_COMMAND`` (a JSON argv list with the restart placeholders);
- ``AERIE_SYNC_LAUNCHED_WITH``: the manifest number the engines were launched with
  (``aerie serving-args`` prints it); unset, what is current when the hook first runs;
- ``AERIE_SYNC_CACHE_DIR``: local drafter copies (default ``~/.cache/aerie/drafters``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from pipeline.release.actuators import (
    MODES,
    ActuatorFactory,
    ActuatorSettings,
)
from pipeline.release.actuators import actuator_factory as serving_actuator
from pipeline.release.backend import ServingRefused
from pipeline.serving_now import (
    ServingLaunch,
    ServingManifest,
    canary_servers,
    launch_of,
    read_serving,
    read_serving_entry,
    resolve_serving,
)
from pipeline.storage import Storage
from pipeline.verified import IntegrityError

log = logging.getLogger(__name__)

# the serving actuators' modes, with "fetch" for the manifest mode (fetch only)
SYNC_MODES = ("fetch", *(mode for mode in MODES if mode != "manifest"))


class DrafterSync:
    """Hands the promoted drafter to the rollout engines when the serving manifest moves.

    ``launched_with``: the manifest number the engines were launched with (``aerie
    serving-args`` prints it); None takes what is current when the sync is built. Each call
    compares against the last manifest handed over.

    Building it fails loudly (a wrong setting, an unreadable launch manifest: the run has
    not started). After that, a hand-over that fails never stops the RL run: the engines
    keep the drafter they run, the error is logged with its traceback and kept in
    :attr:`last_error`, and the next call tries again, except for a refusal
    (:class:`~pipeline.release.backend.ServingRefused`, or a drafter whose files fail
    verification), which waits for the manifest to move."""

    def __init__(self, storage: Storage, name: str, cache_dir: str | Path,
                 actuator_for: ActuatorFactory | None = None, *,
                 launched_with: int | None = None):
        self.storage = storage
        self.name = name
        self.cache_dir = Path(cache_dir)
        self.actuator_for = actuator_for
        self.last_error: str | None = None
        self._refused: int | None = None  # the manifest a refusal was about
        if launched_with is None:
            self.launch = resolve_serving(storage, name, self.cache_dir)
        else:
            self.launch = launch_of(storage, read_serving_entry(storage, name, launched_with),
                                    self.cache_dir)

    @property
    def sequence(self) -> int | None:
        return self.launch.manifest.sequence if self.launch else None

    def __call__(self) -> ServingLaunch | None:
        """The new launch when the manifest moved (after the engines got it), else None."""
        sequence = None
        try:
            current = read_serving(self.storage, self.name)
            sequence = current.sequence if current else None
            if current is None or sequence in (self.sequence, self._refused):
                return None
            new = launch_of(self.storage, replace(current, canary=None), self.cache_dir)
            self._hand_over(new, current)
        except Exception as e:  # never stops the RL run; see the class docstring
            self.last_error = f"serving manifest {sequence}: {type(e).__name__}: {e}"
            if isinstance(e, ServingRefused | IntegrityError) and sequence is not None:
                self._refused = sequence
            log.exception("drafter sync of %s: %s; the engines keep manifest %s", self.name,
                          self.last_error, self.sequence)
            return None
        self.last_error = None
        log.info("serving %s: manifest %s -> %d (%s)%s", self.name, self.sequence, sequence,
                 new.manifest.target.name if new.manifest.target else "no drafter",
                 "" if self.actuator_for else "; fetched only, the engines are unchanged "
                                               "(AERIE_SYNC_MODE=fetch)")
        self.launch = new
        return new

    def reload_current(self) -> bool:
        """Hand the drafter of the current launch over again (for engines whose draft
        weights do not survive a sync); False, with the error logged and kept, if that
        failed or there is nothing to hand over."""
        if self.launch is None or self.launch.drafter_dir is None or not self.actuator_for:
            return False
        try:
            actuator = self.actuator_for(self.launch.manifest.settings)
            actuator.activate(self.launch.drafter_dir, self.launch.manifest.target)
        except Exception as e:  # never stops the RL run; see the class docstring
            self.last_error = f"reloading manifest {self.sequence}: {type(e).__name__}: {e}"
            log.exception("drafter sync of %s: %s", self.name, self.last_error)
            return False
        return True

    def _hand_over(self, new: ServingLaunch, current_manifest: ServingManifest) -> None:
        if self.actuator_for is None:
            return
        actuator = self.actuator_for(new.manifest.settings)
        current = self.launch.drafter_dir if self.launch else None
        canary = self._canary(current_manifest, actuator)
        if canary is not None:  # the champion's servers first, then the canary's
            servers, launch = canary
            rest = tuple(s for s in actuator.servers if s not in servers)
            self._activate(actuator.on(rest), new, current)
            part = self.actuator_for(launch.manifest.settings).on(servers)
            self._activate(part, launch, current)
            return
        self._activate(actuator, new, current)

    def _canary(self, current: ServingManifest, actuator
                ) -> tuple[tuple[str, ...], ServingLaunch] | None:
        """The canary's servers and its launch, when the manifest carries a canary; a mode
        that cannot address servers one by one refuses it (the champion serves on)."""
        if current.canary is None:
            return None
        fleet = tuple(getattr(actuator, "servers", ()) or ())
        servers = canary_servers(current.canary, fleet)
        if not servers:
            raise ServingRefused(f"canary {current.canary.target.name}: this sync's mode "
                                 f"cannot serve it on part of its servers {list(fleet)}")
        return servers, launch_of(self.storage, current.on(servers[0], fleet),
                                  self.cache_dir)

    @staticmethod
    def _activate(actuator, launch: ServingLaunch, current: Path | None) -> None:
        if launch.drafter_dir is not None:
            actuator.check(launch.drafter_dir, current if actuator.compares_with_current
                           else None)
        actuator.activate(launch.drafter_dir, launch.manifest.target)


def actuator_factory(mode: str, *, server_urls: list[str] | None = None,
                     restart_command: list[str] | None = None, timeout_s: float = 600.0,
                     also: tuple[str, ...] = ()) -> ActuatorFactory | None:
    """What hands a drafter to the engines in ``mode`` (:data:`SYNC_MODES`): the serving
    actuator of the same mode (:mod:`pipeline.release.actuators`)."""
    if mode not in SYNC_MODES:
        raise ValueError(f"AERIE_SYNC_MODE {mode!r} is not one of {SYNC_MODES + also}")
    return serving_actuator(
        "manifest" if mode == "fetch" else mode,
        ActuatorSettings(restart_command=tuple(restart_command or ()),
                         restart_timeout_s=timeout_s, server_urls=tuple(server_urls or ()),
                         reload_timeout_s=timeout_s),
        names={"restart_command": "a restart command (AERIE_SYNC_RESTART_COMMAND, a JSON "
                                  "list)", "server_urls": "AERIE_SYNC_SERVER_URLS"})


def sync_from_env(environ: Mapping[str, str] | None = None, *,
                  extra_modes: Mapping[str, ActuatorFactory] | None = None) -> DrafterSync:
    """The :class:`DrafterSync` the ``AERIE_*`` variables describe (module docstring);
    ``extra_modes``: modes only a framework's hook offers (verl's ``verl-replicas``)."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("AERIE_STORAGE_URL", "AERIE_SERVING_NAME") if not env.get(k)]
    if missing:
        raise ValueError(f"set {' and '.join(missing)}: the drafter sync reads the serving "
                         "manifest of AERIE_SERVING_NAME under AERIE_STORAGE_URL")
    command = env.get("AERIE_SYNC_RESTART_COMMAND")
    try:
        argv = json.loads(command) if command else None
    except json.JSONDecodeError as e:
        raise ValueError(f"AERIE_SYNC_RESTART_COMMAND is not JSON: {e}") from None
    if argv is not None and (not isinstance(argv, list)
                             or not all(isinstance(a, str) for a in argv)):
        raise ValueError("AERIE_SYNC_RESTART_COMMAND must be a JSON list of strings")
    urls = [u.strip() for u in env.get("AERIE_SYNC_SERVER_URLS", "").split(",") if u.strip()]
    mode = env.get("AERIE_SYNC_MODE", "fetch")
    if extra_modes and mode in extra_modes:
        factory = extra_modes[mode]
    else:
        factory = actuator_factory(mode, server_urls=urls, restart_command=argv,
                                   also=tuple(extra_modes or ()))
    launched = env.get("AERIE_SYNC_LAUNCHED_WITH") or None
    if launched is not None and not launched.isdigit():
        raise ValueError(f"AERIE_SYNC_LAUNCHED_WITH {launched!r} is not a manifest number")
    cache = env.get("AERIE_SYNC_CACHE_DIR") or Path.home() / ".cache" / "aerie" / "drafters"
    return DrafterSync(Storage(env["AERIE_STORAGE_URL"]), env["AERIE_SERVING_NAME"], cache,
                       factory, launched_with=int(launched) if launched else None)
