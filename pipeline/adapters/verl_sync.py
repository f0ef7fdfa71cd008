"""verl's weight sync, followed by the drafter's: a ``CheckpointEngineManager`` for
``actor_rollout_ref.rollout.checkpoint_manager_class``.

verl (0.9.1) builds the class named there with ``config=, actor_wg=, replicas=`` and calls
``update_weights(global_steps)`` after every actor update; the stock manager pushes only
the policy. :class:`AerieCheckpointEngineManager` runs the stock sync, then
:class:`~pipeline.adapters.weight_sync.DrafterSync` (configured by the ``AERIE_*``
variables): a promoted drafter reaches the rollout engines at the first sync after its
promotion. ``AERIE_SYNC_MODE=verl-replicas`` reloads it in place into verl's own vLLM
servers, through each replica's server actors (``collective_rpc``, the method of
:class:`~pipeline.adapters.verl_vllm.AerieVerlWorkerExtension`; verl's servers listen on
ports chosen at start, so there are no URLs to configure). The drafter's directory
(``AERIE_SYNC_CACHE_DIR``) must be readable on the rollout nodes.

Colocated (hybrid) replicas sleep between steps, at level 2 unless MTP or LoRA is on, and
verl's own note says drafter-only weights are not restored after a level-2 sleep: its sync
pushes the policy only. So with hybrid replicas this mode reloads the current drafter after
every sync, not only after a promotion. Imports verl: only the verl process loads this
module.

    +actor_rollout_ref.rollout.checkpoint_manager_class=pipeline.adapters.verl_sync.AerieCheckpointEngineManager
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from verl.checkpoint_engine import CheckpointEngineManager
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.replica import RolloutMode

from pipeline.adapters.weight_sync import DrafterSync, sync_from_env
from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.release.vllm_reload import refuse_unreloadable
from pipeline.release.vllm_worker import METHOD, PROBE
from pipeline.serving_now import ServingTarget

log = logging.getLogger(__name__)

REPLICAS_MODE = "verl-replicas"
VERL_EXTENSION = "pipeline.adapters.verl_vllm.AerieVerlWorkerExtension"


class VerlReplicaReload:
    """An :class:`~pipeline.release.backend.Actuator` on verl's rollout replicas: the draft
    weights reloaded in place by every server actor of every replica; a failure part-way
    reloads the previous drafter everywhere it may have reached, then raises."""

    mode = REPLICAS_MODE
    compares_with_current = True

    def __init__(self, replicas: list[Any], settings: SpecParams, *,
                 timeout_s: float = 600.0):
        self.actors = [s for r in replicas for s in r.servers]
        self.servers = tuple(f"replica-{i}/server-{j}" for i, r in enumerate(replicas)
                             for j in range(len(r.servers)))  # a canary's names them so
        self.settings = settings
        self.timeout_s = timeout_s
        self._current: Path | None = None

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        refuse_unreloadable(self.settings, new_dir, current_dir,
                            "launch verl with it (aerie serving-args verl)")
        for server in self.actors:
            try:
                self._call(server, PROBE, require_drafter=True)
            except ray.exceptions.RayTaskError as e:  # the worker ran it and failed
                raise ServingRefused(
                    f"verl's vLLM workers cannot reload a drafter ({str(e)[:300]}); set "
                    f"+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
                    f"{VERL_EXTENSION} and a speculative_config") from e
        self._current = current_dir

    def activate(self, new_dir: Path | None, target: ServingTarget | None) -> dict[str, str]:
        if new_dir is None:
            raise ServingRefused("verl's servers cannot turn speculation off in place")
        if self._current is None:  # a reload of the drafter they run (after a sync)
            self._current = new_dir
        reached = []
        try:
            for server in self.actors:
                reached.append(server)
                self._load(server, new_dir)
        except Exception as e:
            stuck = self._roll_back(reached)
            raise ServingError(f"reloading {new_dir.name} into verl's rollout servers failed "
                               f"({type(e).__name__}: {e})" + (
                                   f"; {stuck} of them could not be given the previous "
                                   "drafter back and run an unrecorded one" if stuck else
                                   "; the previous drafter was reloaded")) from e
        return {"servers": str(len(reached))}

    def on(self, servers: Sequence[str]) -> VerlReplicaReload:
        """The same reload on the named server actors only (a canary's, or the rest)."""
        part = copy.copy(self)
        part.actors = [a for n, a in zip(self.servers, self.actors, strict=True)
                       if n in servers]
        part.servers = tuple(n for n in self.servers if n in servers)
        part._current = None
        return part

    def _call(self, server: Any, method: str, **kwargs: Any) -> None:
        ray.get(server.collective_rpc.remote(method=method, kwargs=kwargs),
                timeout=self.timeout_s)

    def _load(self, server: Any, directory: Path) -> None:
        self._call(server, METHOD, path=str(directory))

    def _roll_back(self, reached: list[Any]) -> int:
        stuck = 0
        for server in reached if self._current is not None else ():
            try:
                self._load(server, self._current)
            except Exception:
                log.exception("verl-replicas: the previous drafter did not reload")
                stuck += 1
        return stuck


class AerieCheckpointEngineManager(CheckpointEngineManager):
    """verl's manager plus the drafter: policy weights first, then a moved manifest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drafter_sync: DrafterSync = sync_from_env(extra_modes={
            REPLICAS_MODE: lambda settings: VerlReplicaReload(self.replicas, settings)})

        self.reload_every_sync = os.environ.get("AERIE_SYNC_MODE") == REPLICAS_MODE and any(
            getattr(r, "rollout_mode", None) == RolloutMode.HYBRID for r in self.replicas)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> Any:
        metrics = await super().update_weights(global_steps)
        moved = await asyncio.to_thread(self.drafter_sync)
        if moved is None and self.reload_every_sync:
            await asyncio.to_thread(self.drafter_sync.reload_current)
        return metrics
