"""The records that cross the process boundary of a training run: spec in, result out.

A :class:`TrainSpec` is everything a training process needs (written as JSON next to the run;
never secrets: storage credentials travel in the child's environment), a :class:`TrainResult`
what it reports back. Both are plain JSON-serialisable dataclasses with a schema version.

Invariant: ``TrainSpec.fingerprint()`` covers every input that changes the trained weights
(config, window data identity, vocab, teacher policy, the warm start's config and weights)
and nothing else: no path, host, run id or timing, so the same inputs map to the same run
directory (and resume) and the same published drafter, in any home.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.training.config import TrainConfig

SPEC_SCHEMA_VERSION = 1
DRAFTER_CONTENT = ("config.json", "model.safetensors")  # what determines a drafter


@dataclass(frozen=True)
class TrainSpec:
    """What to train: config, data window, vocab, teacher, warm start, where to write."""

    config: TrainConfig
    storage_url: str
    step: int  # the refresh step: its policy is the teacher, its name the drafter's
    window_steps: tuple[int, ...]
    shard_manifest_sha256: dict[str, str]  # step -> sha256 of its shard manifest bytes
    vocab_key: str  # cache key of the vocab mapping (``vocab/<key>/``)
    policy_sha256: str
    work_dir: str  # checkpoints, result.json, train.log
    out_dir: str  # the exported SGLang drafter
    warm_start_dir: str | None = None  # a local drafter directory, or None (scratch)
    warm_start_source: str | None = None  # where it came from (storage key or local URI)
    # and its content hash, for lineage
    warm_start_identity: str | None = None  # what the fingerprint covers of the warm start
    # (``sha256:`` of its config and weights, see :func:`drafter_content_sha256`)
    superseded_identity: str | None = None  # the identity an earlier definition gave the
    # same warm start (see :meth:`superseded`)
    schema_version: int = SPEC_SCHEMA_VERSION

    def fingerprint(self) -> str:
        payload = {"config": self.config.fingerprint(), "step": self.step,
                   "window": list(self.window_steps), "shards": self.shard_manifest_sha256,
                   "vocab": self.vocab_key, "policy": self.policy_sha256,
                   "warm_start": self.warm_start_identity, "schema": self.schema_version}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def superseded(self) -> TrainSpec | None:
        """This spec as the earlier definition fingerprinted it, or None when nothing
        changed. Until #39 a warm start entered the fingerprint as its source label, whose
        hash covered the source drafter's whole manifest, training timings included; a
        drafter committed under that fingerprint is these inputs' drafter and is kept."""
        if self.superseded_identity is None:
            return None
        return replace(self, warm_start_identity=self.superseded_identity,
                       superseded_identity=None)


def drafter_content_sha256(files: Mapping[str, str]) -> str:
    """The identity of a drafter's content: sha256 over the sha256 of its ``config.json``
    and ``model.safetensors`` (``files``: name -> sha256 hex), whatever else its directory or
    manifest holds (a training curve, timings) and wherever it is stored."""
    missing = [name for name in DRAFTER_CONTENT if name not in files]
    if missing:
        raise ValueError(f"a drafter needs {', '.join(DRAFTER_CONTENT)}; missing {missing}")
    listing = [[name, files[name]] for name in DRAFTER_CONTENT]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports (rank 0 writes it as ``result.json``)."""

    fingerprint: str
    steps: int
    steps_per_epoch: int
    epochs: float
    samples: int  # in the window
    tokens_trained: int  # real tokens through the drafter, all ranks, this process lifetime
    seconds: float  # training loop wall time of this process lifetime
    tokens_per_s: float
    samples_per_s: float
    resumed_from_step: int | None
    world_size: int
    zero_stage: int
    dtype: str
    final: dict[str, Any]  # MetricSums.summary() over the last quarter of the run (≤ 1 epoch)
    first: dict[str, Any]  # the same over the first quarter (the trend)
    history: list[dict[str, Any]] = field(default_factory=list)  # per logged step
    warm_start: dict[str, Any] = field(default_factory=dict)
    drafter_config: dict[str, Any] = field(default_factory=dict)  # SGLang config.json
    out_dir: str = ""  # where this process exported it ("" in the drafter's manifest)
    schema_version: int = SPEC_SCHEMA_VERSION
