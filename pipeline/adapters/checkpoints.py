"""Which checkpoint directory holds the policy that generated a step's rollouts.

RL trainers save the policy every few steps into numbered directories (TRL
``checkpoint-{N}``, verl ``global_step_{N}``); the policy after ``N`` updates generated the
rollouts of version ``N``. :func:`policy_checkpoint` finds that directory, or the newest
one saved before it, or the initial policy, and says which version it is, so the snapshot
records the checkpoint it really publishes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PolicyCheckpoint:
    """An HF checkpoint directory and the number of policy updates behind it."""

    path: Path
    version: int


def policy_checkpoint(root: Path, pattern: str, version: int, initial: Path | None,
                      shift: int = 0) -> PolicyCheckpoint:
    """The checkpoint of ``version`` under ``root`` (``pattern`` with one ``{N}``, a path
    relative to ``root`` such as ``checkpoint-{N}`` or ``global_step_{N}/actor/huggingface``)
    or, when that one was not saved, the newest saved before it; version 0 or nothing saved
    yet is ``initial``. A directory counts once it holds ``config.json`` and safetensors
    weights (verl writes ``actor/huggingface`` with the config alone unless asked for the
    weights; a trainer writes the config before the weights). ``shift``: the
    number in a directory's name is its version plus ``shift`` (slime names the policy
    after N steps by rollout N - 1: shift -1).

    ``FileNotFoundError`` when nothing fits (no saved checkpoint and no ``initial``).
    """
    head, _, tail = pattern.partition("{N}")
    if not _ or "{N}" in tail:
        raise ValueError(f"checkpoint pattern {pattern!r} needs exactly one {{N}}")
    shape = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))
    best: PolicyCheckpoint | None = None
    for path in Path(root).glob(pattern.replace("{N}", "*")) if version > 0 else ():
        m = shape.fullmatch(path.relative_to(root).as_posix())
        if m is None or not is_policy_dir(path):
            continue
        n = int(m.group(1)) - shift
        if 0 < n <= version and (best is None or n > best.version):
            best = PolicyCheckpoint(path, n)
    if best is not None:
        return best
    if initial is None or not is_policy_dir(Path(initial)):
        raise FileNotFoundError(
            f"no policy checkpoint for version {version}: nothing matching {pattern!r} with "
            f"N <= {version} under {root} holds config.json and *.safetensors, and neither "
            f"does the initial policy dir ({initial})")
    return PolicyCheckpoint(Path(initial), 0)


def is_policy_dir(path: Path) -> bool:
    """An HF model directory with its weights: ``config.json`` and ``*.safetensors``."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
