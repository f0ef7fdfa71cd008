"""The held-out split: which prompts no drafter ever trains on, so evaluation can use them.

A sample's *prompt* is its tokens before the first trained token (``loss_mask``); the split
hashes the prompt's token ids with a salt and holds out the samples whose hash falls below
``fraction``. Consequences:

- deterministic and stateless: the same prompt is held out in every RL step, on every
  machine, whoever asks (extraction skips it, evaluation picks it);
- by prompt, not by rollout: the RL group of a prompt (several samples) lands on one side,
  so a held-out prompt's siblings cannot leak into training;
- recorded as lineage (``to_dict``) in the shard manifests that applied it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_SALT = "aerie-heldout-v1"


def prompt_of(input_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """The tokens before the first trained one (all of them if none is trained)."""
    trained = np.flatnonzero(np.asarray(loss_mask))
    return np.asarray(input_ids)[:trained[0] if len(trained) else len(input_ids)]


@dataclass(frozen=True)
class HeldoutSplit:
    """Hold out the prompts whose salted hash is below ``fraction`` (0 = none, 1 = all)."""

    fraction: float = 0.0
    salt: str = DEFAULT_SALT

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"held-out fraction must be in [0, 1], got {self.fraction}")

    def prompt_key(self, prompt_ids: np.ndarray) -> str:
        """Hex sha256 of the salt and the prompt's int32 little-endian token ids."""
        data = np.asarray(prompt_ids, dtype="<i4").tobytes()
        return hashlib.sha256(self.salt.encode() + b"\0" + data).hexdigest()

    def holds_out(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> bool:
        """True iff this sample's prompt belongs to the held-out side."""
        if self.fraction <= 0.0:
            return False
        key = self.prompt_key(prompt_of(input_ids, loss_mask))
        return int(key[:16], 16) / 2.0 ** 64 < self.fraction

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
