"""The ``vllm-reload`` mode: new draft weights into running vLLM servers, from disk.

Each server must run Aerie's worker extension (:mod:`pipeline.release.vllm_worker`) in dev
mode; per server, in order: ``POST /pause?mode=wait`` (in-flight requests finish, new ones
wait), ``POST /collective_rpc`` with ``aerie_load_draft_weights`` and the drafter directory
(a path the server's host sees: a shared filesystem or the same host), then
``POST /resume``. Only a drafter the running one can be overwritten by qualifies: the same
shapes, aux layers and RoPE (vLLM re-reads the weights and ``d2t``, not the config); anything
else needs ``vllm-restart``.

The servers must import Aerie (``pip install aerie`` in vLLM's environment) for the
extension to load.

Invariants:

- Refusals (shapes/aux/RoPE differ, a tree topk, "no drafter", a server without dev mode,
  the extension or a drafter) come from ``check``, which only probes
  (``aerie_draft_loader``): no server is paused or changed.
- ``/resume`` follows every ``/pause`` attempt, also when the pause or the load failed.
- A failure part-way re-loads the previous drafter into every server it may have reached
  (the switched ones and the one that failed), all of them attempted; the failure is then
  raised, naming any server left on an unrecorded drafter.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from pipeline.algorithms import algorithm_of_directory
from pipeline.eagle3.config import shapes_match
from pipeline.eagle3.export import read_drafter_config
from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.release.vllm_worker import EXTENSION, METHOD, PROBE
from pipeline.serving_now import ServingTarget

log = logging.getLogger(__name__)


def reload_refusals(current_dir: Path, new_dir: Path) -> tuple[str, ...]:
    """Why ``new_dir``'s weights cannot be loaded in place of ``current_dir``'s (empty: they
    can): vLLM re-reads the weights and ``d2t``, never ``config.json``, so the shapes, the
    aux layers and the RoPE must be the running drafter's."""
    try:
        was, now = algorithm_of_directory(current_dir), algorithm_of_directory(new_dir)
    except ValueError as e:  # an UnknownAlgorithmError
        return (f"cannot read drafter configs: {e}",)
    if was != now or now.vllm_method != "eagle3":
        return (f"the serving drafter is {was.title} and the new one {now.title}: this mode "
                f"reloads EAGLE-3 weights over an EAGLE-3 drafter of the same kind only",)
    try:
        old, new = read_drafter_config(current_dir), read_drafter_config(new_dir)
    except (OSError, ValueError, KeyError) as e:
        return (f"cannot read drafter configs: {e}",)
    reasons = []
    if not shapes_match(old, new):
        reasons.append("drafter shapes differ from the serving drafter's")
    if (old.rope_theta, old.rope_scaling) != (new.rope_theta, new.rope_scaling):
        # weights are reloaded, config.json is not: the server would keep the old rotation
        reasons.append(f"RoPE (theta {new.rope_theta}, scaling {new.rope_scaling}) differs "
                       f"from the serving drafter's (theta {old.rope_theta}, scaling "
                       f"{old.rope_scaling})")
    if old.aux_layer_ids != new.aux_layer_ids:
        reasons.append(f"aux layer ids {list(new.aux_layer_ids)} differ from the serving "
                       f"{list(old.aux_layer_ids)}")
    return tuple(reasons)


def refuse_unreloadable(settings: SpecParams, new_dir: Path, current_dir: Path | None,
                        how_to_launch: str) -> None:
    """:class:`ServingRefused` unless vLLM can reload ``new_dir`` over ``current_dir`` in
    place: a chain (vLLM drafts EAGLE-3 with topk 1 only), a drafter running, and the same
    shapes, aux layers and RoPE (vLLM re-reads weights and ``d2t``, not the config)."""
    if settings.eagle_topk != 1:
        raise ServingRefused("vLLM drafts EAGLE-3 as a chain only: eagle_topk must be 1")
    if current_dir is None:
        raise ServingRefused(f"no recorded drafter runs to reload over; {how_to_launch}")
    reasons = reload_refusals(current_dir, new_dir)
    if reasons:
        raise ServingRefused("cannot reload in place: " + "; ".join(reasons)
                             + f"; {how_to_launch}")


class RPCFailed(ServingError):
    """A server answered with an error status (``status``)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class VllmReloadClient:
    """One vLLM server's dev-mode routes."""

    def __init__(self, base_url: str, *, timeout_s: float = 120.0,
                 session: requests.Session | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = session or requests.Session()

    def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        try:
            r = self.session.post(f"{self.base_url}{path}", json=payload,
                                  timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ServingError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        if r.status_code == 404 and path.startswith("/collective_rpc"):
            raise ServingRefused(f"{self.base_url}: no /collective_rpc; start vLLM with "
                                 "VLLM_SERVER_DEV_MODE=1")
        if r.status_code != 200:
            raise RPCFailed(f"{self.base_url}{path}: HTTP {r.status_code}: {r.text[:500]}",
                            r.status_code)
        try:
            return r.json() if r.content else {}
        except ValueError as e:
            raise ServingError(f"{self.base_url}{path}: not JSON: {r.text[:200]!r}") from e

    def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """``method`` on every worker (``/collective_rpc``): their results."""
        out = self.post("/collective_rpc", {"method": method, "kwargs": kwargs})
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise ServingError(f"{self.base_url}: {method} answered {str(out)[:300]}")
        return results

    def probe(self) -> None:
        """Refuse a server that cannot reload a drafter, without changing anything."""
        try:
            results = self.rpc(PROBE)
        except RPCFailed as e:
            if e.status != 500:  # 500: the server ran the call and a worker had no method
                raise
            raise ServingRefused(f"{self.base_url}: the worker extension does not answer "
                                 f"({e}); start vLLM with --worker-extension-cls "
                                 f"{EXTENSION}") from e
        if not all(isinstance(r, dict) and r.get("drafter") for r in results):
            raise ServingRefused(f"{self.base_url}: a worker runs no EAGLE drafter "
                                 f"({results}); start vLLM with --speculative-config")

    def load_draft(self, drafter_dir: Path) -> list[Any]:
        """Pause, load ``drafter_dir`` on every worker, resume; the workers' results."""
        try:
            self.post("/pause?mode=wait")
            results = self.rpc(METHOD, path=str(drafter_dir))
        finally:
            self.post("/resume")
        if not all(isinstance(r, dict) and isinstance(r.get("tensors"), int)
                   and r["tensors"] > 0 for r in results):
            raise ServingError(f"{self.base_url}: {METHOD} answered {results!r:.300}")
        return results


class VllmDraftReload:
    """An :class:`~pipeline.release.backend.Actuator` that reloads draft weights in place."""

    mode = "vllm-reload"
    compares_with_current = True

    def __init__(self, server_urls: Sequence[str], settings: SpecParams, *,
                 timeout_s: float = 120.0, session: requests.Session | None = None):
        if not server_urls:
            raise ValueError("vllm-reload needs the vLLM servers' base URLs")
        self.clients = [VllmReloadClient(u, timeout_s=timeout_s, session=session)
                        for u in server_urls]
        self.servers = tuple(server_urls)  # as configured: a canary's servers name them so
        self.settings = settings
        self._current: Path | None = None

    def on(self, servers: Sequence[str]) -> VllmDraftReload:
        """The same reload on ``servers`` only (a canary's, or the rest of them)."""
        part = copy.copy(self)
        part.clients = [c for u, c in zip(self.servers, self.clients, strict=True)
                        if u in servers]
        part.servers = tuple(u for u in self.servers if u in servers)
        part._current = None
        return part

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        refuse_unreloadable(self.settings, new_dir, current_dir,
                            "start the servers with it (vllm-restart)")
        for client in self.clients:
            client.probe()
        self._current = current_dir

    def activate(self, new_dir: Path | None, target: ServingTarget | None) -> dict[str, str]:
        if new_dir is None:
            raise ServingRefused("vllm-reload cannot turn speculation off; use vllm-restart "
                                 "with no_drafter_command")
        reached: list[VllmReloadClient] = []
        try:
            for client in self.clients:
                reached.append(client)  # from the first request on, it may hold new weights
                client.load_draft(new_dir)
        except Exception as e:  # whatever failed, the servers reached get their drafter back
            self._roll_back(reached, e)
            if isinstance(e, ServingError):
                raise
            raise ServingError(f"vllm-reload failed: {type(e).__name__}: {e}") from e
        log.info("vllm-reload: %d servers run %s", len(reached), new_dir.name)
        return {"servers": str(len(reached))}

    def _roll_back(self, reached: list[VllmReloadClient], error: Exception) -> None:
        if self._current is None:
            return
        stuck = []
        for client in reached:
            try:
                client.load_draft(self._current)
            except ServingError as again:
                stuck.append(f"{client.base_url} ({again})")
        if stuck:
            raise ServingError(f"vllm-reload failed ({error}) and the previous drafter could "
                               f"not be reloaded into {', '.join(stuck)}: they run an "
                               "unrecorded drafter") from error
