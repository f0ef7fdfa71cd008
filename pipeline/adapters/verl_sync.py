"""verl's weight sync, followed by the drafter's: a ``CheckpointEngineManager`` for
``actor_rollout_ref.rollout.checkpoint_manager_class``.

verl (0.9.1) builds the class named there with ``config=, actor_wg=, replicas=`` and calls
``update_weights(global_steps)`` after every actor update; the stock manager pushes only
the policy. :class:`AerieCheckpointEngineManager` runs the stock sync, then
:class:`~pipeline.adapters.weight_sync.DrafterSync` (configured by the ``AERIE_*``
variables): a promoted drafter reaches the rollout engines at the first sync after its
promotion. Imports verl: only the verl process loads this module.

    +actor_rollout_ref.rollout.checkpoint_manager_class=pipeline.adapters.verl_sync.AerieCheckpointEngineManager
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl.checkpoint_engine import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from pipeline.adapters.weight_sync import DrafterSync, sync_from_env

MANIFEST_METRIC = "aerie/serving_manifest"


class AerieCheckpointEngineManager(CheckpointEngineManager):
    """verl's manager plus the drafter: policy weights first, then a moved manifest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drafter_sync: DrafterSync = sync_from_env()

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        metrics = await super().update_weights(global_steps)
        launch = await asyncio.to_thread(self.drafter_sync)
        if launch is None:
            return metrics
        return {**(metrics or {}), MANIFEST_METRIC: launch.manifest.sequence}
