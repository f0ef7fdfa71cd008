"""The ``sglang-restart`` and ``vllm-restart`` modes: run an operator's command that
restarts the rollout engine on a drafter.

The command is an argv list (no shell) whose items may contain placeholders:

    {drafter_dir}        local directory of the drafter to serve
    {num_steps} {topk} {num_draft_tokens}    the speculative settings the drafter is
                         served with (a DFlash drafter's: its block's chain)
    {algorithm}          SGLang's --speculative-algorithm for the drafter (EAGLE3, DFLASH)
    {registry_version} {fingerprint}         which registered drafter it is
    {speculative_config}  vLLM's --speculative-config JSON for the drafter (vllm-restart;
                          chains only, so an EAGLE-3 drafter's topk must be 1)
    {server}             one of the configured servers (``server_urls``): the command is
                         then run once per server, and a canary can restart only its own

e.g. ``["systemctl", "restart", "sglang@{registry_version}"]`` or
``["/opt/aerie/restart-sglang.sh", "{drafter_dir}"]``, where the script relaunches
``python -m sglang.launch_server ... --speculative-algorithm EAGLE3
--speculative-draft-model-path "$1" ...`` and returns only once the new server is healthy
(the safe way: start the new server, check ``/health_generate``, then stop the old one).

Invariants:

- No shell: items are formatted one by one and passed to ``subprocess`` as a list; unknown
  placeholders are rejected when the hook is built, not when it runs.
- Success means exit status 0 within ``timeout_s``. A non-zero exit raises
  :class:`ServingError` carrying the tail of stderr; a timeout kills the command's whole
  process group and raises.
- The command line itself is never logged (it may carry tokens); only the executable name.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.algorithms import format_errors, read_config, serving_of
from pipeline.argv_template import placeholders
from pipeline.drafters.algorithm import DrafterAlgorithm
from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.serving_now import ServingTarget

log = logging.getLogger(__name__)

PLACEHOLDERS = frozenset({"drafter_dir", "num_steps", "topk", "num_draft_tokens", "algorithm",
                          "registry_version", "fingerprint", "speculative_config", "server"})
RESTART_MODES = ("sglang-restart", "vllm-restart")
_TAIL = 2000


class RestartHook:
    """An :class:`~pipeline.release.backend.Actuator` that runs a restart command."""

    compares_with_current = False

    def __init__(self, argv: Sequence[str], settings: SpecParams, *,
                 timeout_s: float = 600.0, no_drafter_argv: Sequence[str] | None = None,
                 cwd: str | Path | None = None, env: Mapping[str, str] | None = None,
                 mode: str = "sglang-restart", servers: Sequence[str] = ()):
        if not argv:
            raise ValueError("the restart command must not be empty")
        if mode not in RESTART_MODES:
            raise ValueError(f"restart mode {mode!r} is not one of {RESTART_MODES}")
        self.mode = mode
        for name, cmd in (("argv", argv), ("no_drafter_argv", no_drafter_argv or ["x"])):
            unknown = placeholders(cmd) - PLACEHOLDERS
            if unknown:
                raise ValueError(f"{name} uses unknown placeholders {sorted(unknown)}; "
                                 f"known: {sorted(PLACEHOLDERS)}")
        if no_drafter_argv and placeholders(no_drafter_argv) & {
                "drafter_dir", "fingerprint", "registry_version", "speculative_config"}:
            raise ValueError("no_drafter_argv cannot name a drafter")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        per_server = "server" in placeholders(argv) | placeholders(no_drafter_argv or ())
        if per_server and not servers:
            raise ValueError("a restart command with {server} needs the servers "
                             "(server_urls)")
        self.servers = tuple(servers) if per_server else ()  # () : one run for all
        self.argv = tuple(argv)
        self.no_drafter_argv = tuple(no_drafter_argv) if no_drafter_argv else None
        self.settings = settings
        self.timeout_s = timeout_s
        self.cwd = str(cwd) if cwd else None
        self.env = dict(env) if env is not None else None

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        errors = format_errors(new_dir)
        if errors:
            raise ServingRefused(f"{new_dir} is not a loadable drafter: {'; '.join(errors)}")
        if "speculative_config" in placeholders(self.argv):
            self._speculative_config(new_dir)  # refuses a tree before anything runs

    def _served_as(self, new_dir: Path) -> tuple[DrafterAlgorithm, SpecParams]:
        try:
            return serving_of(read_config(new_dir), self.settings, str(new_dir))
        except ValueError as e:
            raise ServingRefused(f"{new_dir} is not a loadable drafter: {e}") from e

    def _speculative_config(self, new_dir: Path) -> str:
        algorithm, settings = self._served_as(new_dir)
        try:
            return algorithm.vllm_speculative_config(settings, str(new_dir))
        except ValueError as e:
            raise ServingRefused(str(e)) from e

    def activate(self, new_dir: Path | None, target: ServingTarget | None) -> dict[str, str]:
        algorithm, settings = (None, self.settings) if new_dir is None else \
            self._served_as(new_dir)
        values = {"server": "{server}", "num_steps": settings.num_steps,
                  "topk": settings.eagle_topk, "num_draft_tokens": settings.num_draft_tokens,
                  "algorithm": algorithm.sglang_algorithm if algorithm else ""}
        if new_dir is None:
            if self.no_drafter_argv is None:
                raise ServingRefused("sglang-restart cannot serve 'no drafter': configure "
                                     "no_drafter_argv to restart SGLang without speculation")
            argv = [a.format_map(values) for a in self.no_drafter_argv]
        else:
            values |= {"drafter_dir": str(new_dir),
                       "registry_version": target.registry_version if target else "",
                       "fingerprint": target.fingerprint if target else ""}
            if "speculative_config" in placeholders(self.argv):
                values["speculative_config"] = self._speculative_config(new_dir)
            argv = [a.format_map(values) for a in self.argv]
        if not self.servers:
            return run_hook(argv, timeout_s=self.timeout_s, cwd=self.cwd, env=self.env)
        details: dict[str, str] = {}
        for server in self.servers:  # argv was formatted with {server} left as it was
            done = run_hook([a.replace("{server}", server) for a in argv],
                            timeout_s=self.timeout_s, cwd=self.cwd, env=self.env)
            details = {**done, "servers": str(len(self.servers))}
        return details

    def on(self, servers: Sequence[str]) -> RestartHook:
        """The same hook run for ``servers`` only (a canary's, or the rest of them)."""
        part = copy.copy(self)
        part.servers = tuple(s for s in self.servers if s in servers)
        return part


def run_hook(argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Run ``argv`` (no shell) in its own process group; details on success, else raise."""
    name = Path(argv[0]).name
    start = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd,
                                env=dict(env) if env is not None else None,
                                start_new_session=True)
    except OSError as e:
        raise ServingError(f"restart hook {name}: cannot start ({e})") from e
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate(timeout=30)
        raise ServingError(f"restart hook {name}: timed out after {timeout_s:g}s and was "
                           f"killed; stderr: {_tail(err)}") from None
    seconds = time.monotonic() - start
    log.debug("restart hook %s stdout: %s", name, _tail(out))
    if proc.returncode != 0:
        raise ServingError(f"restart hook {name}: exit status {proc.returncode}; stderr: "
                           f"{_tail(err)}")
    log.info("restart hook %s succeeded in %.1fs", name, seconds)
    return {"hook": name, "exit_status": "0", "seconds": f"{seconds:.3f}"}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the hook and everything it started
    except ProcessLookupError:
        pass


def _tail(data: bytes | None) -> str:
    text = (data or b"").decode(errors="replace").strip()
    return text[-_TAIL:] if text else "(empty)"
