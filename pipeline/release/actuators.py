"""The serving actuators, registered once: what a serving mode does, beside recording the
served drafter in the ledger, to hand a drafter to the rollout engines.

``ACTUATORS`` maps a mode to a function that checks the mode's settings and returns the
factory of its :class:`~pipeline.release.backend.Actuator` for given speculative settings
(None for ``manifest``, whose manifest is the update). The serving resource
(``resources/serving.py``) and the trainer-side drafter sync
(:mod:`pipeline.adapters.weight_sync`) both build actuators here, so a new mode is one
actuator class and one entry in this dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.eagle3.spec import SpecParams

if TYPE_CHECKING:
    from pipeline.release.backend import Actuator

ActuatorFactory = Callable[[SpecParams], "Actuator"]


@dataclass(frozen=True)
class ActuatorSettings:
    """Every setting an actuator may take; each mode reads its own."""

    restart_command: tuple[str, ...] = ()  # argv of the restart hook (no shell)
    no_drafter_command: tuple[str, ...] = ()  # argv that restarts without a drafter
    restart_timeout_s: float = 900.0
    server_urls: tuple[str, ...] = ()  # vllm-reload: the servers' base URLs; restart
    # commands with {server}: the servers they run for
    reload_timeout_s: float = 120.0  # vllm-reload: per request


def _none(mode: str, settings: ActuatorSettings, names: Mapping[str, str]) -> None:
    return None


def _restart(mode: str, settings: ActuatorSettings,
             names: Mapping[str, str]) -> ActuatorFactory:
    from pipeline.release.restart import RestartHook  # torch: only when used

    if not settings.restart_command:
        raise ValueError(f"mode {mode} needs "
                         f"{names.get('restart_command', 'restart_command')}")
    argv, undo = list(settings.restart_command), list(settings.no_drafter_command) or None

    def build(spec: SpecParams) -> Actuator:
        return RestartHook(argv, spec, timeout_s=settings.restart_timeout_s,
                           no_drafter_argv=undo, mode=mode, servers=settings.server_urls)

    build(SpecParams(1, 1, 2))  # the commands' placeholders are checked now
    return build


def _reload(mode: str, settings: ActuatorSettings,
            names: Mapping[str, str]) -> ActuatorFactory:
    from pipeline.release.vllm_reload import VllmDraftReload  # torch: only when used

    if not settings.server_urls:
        raise ValueError(f"mode {mode} needs the vLLM servers' base URLs "
                         f"({names.get('server_urls', 'server_urls')})")
    urls = list(settings.server_urls)
    return lambda spec: VllmDraftReload(urls, spec, timeout_s=settings.reload_timeout_s)


ACTUATORS: dict[str, Callable[[str, ActuatorSettings, Mapping[str, str]],
                              ActuatorFactory | None]] = {
    "manifest": _none,
    "sglang-restart": _restart,
    "vllm-restart": _restart,
    "vllm-reload": _reload,
}
MODES = tuple(ACTUATORS)


def actuator_factory(mode: str, settings: ActuatorSettings,
                     names: Mapping[str, str] | None = None) -> ActuatorFactory | None:
    """The factory of ``mode``'s actuator (None: the manifest alone), its settings checked;
    ``names`` says how the caller's users set a setting (``{"server_urls":
    "AERIE_SYNC_SERVER_URLS"}``), for the errors."""
    if mode not in ACTUATORS:
        raise ValueError(f"serving mode {mode!r} is not one of {MODES}")
    return ACTUATORS[mode](mode, settings, names or {})
