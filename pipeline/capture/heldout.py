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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.capture.shards import read_shards_manifest
from pipeline.contracts import Manifest
from pipeline.layout import shards_prefix
from pipeline.storage import Storage
from pipeline.tokenize.reader import iter_tokenized

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


@dataclass(frozen=True)
class HeldoutPrompt:
    """One held-out prompt: where it came from and its token ids."""

    key: str  # HeldoutSplit.prompt_key of the ids
    step: int
    sample_id: str  # the first sample seen with this prompt
    prompt_ids: tuple[int, ...]


def heldout_prompts(storage: Storage, steps: Sequence[int], max_prompts: int
                    ) -> tuple[HeldoutSplit, list[HeldoutPrompt]]:
    """The distinct held-out prompts of ``steps``, at most ``max_prompts`` of them.

    The split is the one extraction applied (read from each step's shard manifest; the steps
    must agree). The choice is deterministic: prompts sorted by key (a salted hash, so an
    unbiased sample), then cut. Raises ``ValueError`` when the steps hold no held-out prompt.
    """
    splits = {s: _split_of(read_shards_manifest(storage, s, data=False), storage, s)
              for s in steps}
    if not splits:
        raise ValueError("heldout_prompts needs at least one step")
    if len(set(splits.values())) != 1:
        raise ValueError(f"steps {list(steps)} were extracted with different held-out "
                         f"splits: {sorted({str(v) for v in splits.values()})}")
    split = next(iter(splits.values()))
    found: dict[str, HeldoutPrompt] = {}
    for step in steps:
        for s in iter_tokenized(storage, step):
            if split.holds_out(s.input_ids, s.loss_mask):
                prompt = prompt_of(s.input_ids, s.loss_mask)
                key = split.prompt_key(prompt)
                found.setdefault(key, HeldoutPrompt(key, step, s.sample_id,
                                                    tuple(int(x) for x in prompt)))
    if not found:
        raise ValueError(f"no held-out prompt in steps {list(steps)} (fraction "
                         f"{split.fraction}): extract with heldout_fraction > 0")
    return split, [found[k] for k in sorted(found)][:max_prompts]


def _split_of(manifest: Manifest, storage: Storage, step: int) -> HeldoutSplit:
    meta = manifest.meta.get("heldout")
    if meta is None:
        raise ValueError(f"{storage.url(shards_prefix(step))}: shards carry no held-out split "
                         f"(extracted before held-out splits existed)")
    return HeldoutSplit(meta["fraction"], meta["salt"])
