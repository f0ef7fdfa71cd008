"""The ``vllm-reload`` mode: new draft weights into running vLLM servers, from disk.

Each server must run Aerie's worker extension (:mod:`pipeline.release.vllm_worker`) in dev
mode; per server, in order: ``POST /pause?mode=wait`` (in-flight requests finish, new ones
wait), ``POST /collective_rpc`` with ``aerie_load_draft_weights`` and the drafter directory
(a path the server's host sees: a shared filesystem or the same host), then
``POST /resume``. Only a drafter the running one can be overwritten by qualifies: the same
shapes, aux layers and RoPE (vLLM re-reads the weights and ``d2t``, not the config); anything
else needs ``vllm-restart``.

Invariants:

- Refusals (no extension-compatible drafter, shapes/aux/RoPE differ, a tree topk, "no
  drafter") come from ``check``/before the first request: nothing is sent.
- A server that was paused is always resumed, also when its load failed.
- A failure part-way re-loads the previous drafter into the servers already switched, so
  the servers never run two drafters; the failure is then raised.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.release.hotswap import hotswap_refusals
from pipeline.release.vllm_worker import METHOD
from pipeline.serving_now import ServingTarget

log = logging.getLogger(__name__)


class VllmReloadClient:
    """One vLLM server's dev-mode routes."""

    def __init__(self, base_url: str, *, timeout_s: float = 120.0,
                 session: requests.Session | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = session or requests.Session()

    def post(self, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            r = self.session.post(f"{self.base_url}{path}", json=payload,
                                  timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ServingError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        if r.status_code == 404 and path.startswith("/collective_rpc"):
            raise ServingRefused(f"{self.base_url}: no /collective_rpc; start vLLM with "
                                 "VLLM_SERVER_DEV_MODE=1")
        if r.status_code != 200:
            raise ServingError(f"{self.base_url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def load_draft(self, drafter_dir: Path) -> list[Any]:
        """Pause, load ``drafter_dir`` on every worker, resume; the workers' results."""
        self.post("/pause?mode=wait")
        try:
            out = self.post("/collective_rpc", {"method": METHOD,
                                                "kwargs": {"path": str(drafter_dir)}})
        finally:
            self.post("/resume")
        results = out.get("results")
        if not isinstance(results, list) or not results or not all(
                isinstance(r, dict) and r.get("tensors", 0) > 0 for r in results):
            raise ServingError(f"{self.base_url}: {METHOD} answered {str(out)[:300]}; is the "
                               f"worker extension loaded (--worker-extension-cls)?")
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
        self.settings = settings
        self._current: Path | None = None

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        if self.settings.eagle_topk != 1:
            raise ServingRefused("vLLM drafts EAGLE-3 as a chain only: eagle_topk must be 1")
        if current_dir is None:
            raise ServingRefused("vllm-reload overwrites the drafter a server runs; with none "
                                 "recorded, start the servers with it (vllm-restart)")
        reasons = hotswap_refusals(current_dir, new_dir, same_d2t=False)
        if reasons:
            raise ServingRefused("cannot reload in place: " + "; ".join(reasons)
                                 + " (use vllm-restart)")
        self._current = current_dir

    def activate(self, new_dir: Path | None, target: ServingTarget | None) -> dict[str, str]:
        if new_dir is None:
            raise ServingRefused("vllm-reload cannot turn speculation off; use vllm-restart "
                                 "with no_drafter_command")
        done: list[VllmReloadClient] = []
        try:
            for client in self.clients:
                client.load_draft(new_dir)
                done.append(client)
        except ServingError as e:
            self._roll_back(done, e)
            raise
        log.info("vllm-reload: %d servers run %s", len(done), new_dir.name)
        return {"servers": str(len(done))}

    def _roll_back(self, done: list[VllmReloadClient], error: Exception) -> None:
        if not done or self._current is None:
            return
        for client in done:
            try:
                client.load_draft(self._current)
            except ServingError as again:
                raise ServingError(f"vllm-reload failed ({error}) and {client.base_url} could "
                                   f"not be given its previous drafter back ({again}); it runs "
                                   "an unrecorded drafter") from again
