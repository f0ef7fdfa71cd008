"""slime's disk weight sync, followed by the drafter's: the function for
``--custom-update-weight-post-write-path pipeline.adapters.slime_hook.post_write``.

slime calls it as ``hook(args, version_dir, rollout_engines)`` on every trainer rank after
a disk sync (``--update-weight-transport disk``) wrote ``version_dir`` and before the
engines read it. Rank 0 runs :class:`~pipeline.adapters.weight_sync.DrafterSync`
(configured by the ``AERIE_*`` variables); the other ranks return at once.
"""

from __future__ import annotations

from typing import Any

from pipeline.adapters.weight_sync import DrafterSync, sync_from_env

_sync: DrafterSync | None = None


def post_write(args: Any, version_dir: str, rollout_engines: list[Any]) -> None:
    global _sync
    if _rank() != 0:
        return
    if _sync is None:
        _sync = sync_from_env()
    _sync()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
