"""The ``vocab_mapping`` stage: the draft vocabulary of a refresh step's training window.

Counts target token ids under the loss mask over the window's training samples (the shards'
``input_ids`` and ``loss_mask`` columns only; Parquet reads no state bytes for them; held-out
prompts are not in the shards, so they never shape the draft vocab), chooses
the top ``draft_vocab_size`` with :func:`pipeline.vocab.mapping.build_vocab_mapping` and stores
it content-addressed:

- ``vocab/<cache_key>/vocab_mapping.safetensors`` + ``_manifest.json`` — ``cache_key`` =
  :func:`vocab_cache_key` of the shard files' sha256 and both vocab sizes; present → reused
  without reading any data (a cache hit);
- ``vocab/step=NNNNNN/_manifest.json`` — which mapping (and which window) refresh step
  ``NNNNNN`` uses; the drafter stage reads this pointer, so window and draft vocab size are
  decided once.

Counting is vectorised per Arrow record batch (one boolean gather + ``bincount``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from pipeline.capture.shards import read_shards_manifest
from pipeline.capture.window import WindowError, read_window, verify_window, window_steps
from pipeline.contracts import Manifest
from pipeline.layout import mapping_prefix, shards_prefix, vocab_pointer_prefix
from pipeline.manifest import entry_for, meta_value, read_manifest, write_manifest
from pipeline.parquet import open_parquet
from pipeline.snapshot.policy import load_policy_ref
from pipeline.storage import Storage
from pipeline.verified import committed, read_verified
from pipeline.vocab.mapping import (
    TokenCounter,
    VocabMapping,
    build_vocab_mapping,
    manifest_digests,
    vocab_cache_key,
    vocab_mapping_from_bytes,
    vocab_mapping_to_bytes,
)

VOCAB_KIND = "vocab_mapping"
VOCAB_POINTER_KIND = "vocab_window"
MAPPING_FILE = "vocab_mapping.safetensors"

@dataclass(frozen=True, eq=False)
class WindowVocab:
    """The draft vocab of refresh step ``step`` and how it was obtained."""

    step: int
    window_steps: tuple[int, ...]
    mapping: VocabMapping
    cache_key: str
    cache_hit: bool
    uri: str
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {**self.mapping.summary(), "window_steps": list(self.window_steps),
                "cache_hit": self.cache_hit, "uri": self.uri, "seconds": self.seconds}


def run(storage: Storage, step: int, window: int, draft_vocab_size: int, *,
        target_vocab_size: int | None = None) -> WindowVocab:
    """The draft vocab of the window ``step-window+1 .. step``; cached by content.

    ``target_vocab_size`` defaults to the vocab of the policy checkpoint of ``step``. Raises
    :class:`WindowError` naming the steps whose shards are missing.
    """
    started = time.perf_counter()
    steps = window_steps(step, window)
    shards = read_window(storage, steps, read_shards_manifest, "hidden-state shards")
    vocab = target_vocab_size or load_policy_ref(storage, step).vocab_size
    key = vocab_cache_key(manifest_digests(shards[s] for s in steps), vocab, draft_vocab_size)
    prefix = mapping_prefix(key)
    cached = read_manifest(storage, prefix, kind=VOCAB_KIND)
    if cached is not None:
        mapping = vocab_mapping_from_bytes(read_verified(storage, prefix, cached, MAPPING_FILE))
        hit = True
    else:
        counter = TokenCounter(vocab)
        verify_window(storage, shards)  # count only the bytes the manifests name
        for s in steps:
            _count_step(storage, s, shards[s], counter)
        mapping = build_vocab_mapping(counter.counts(), draft_vocab_size, cache_key=key)
        written = storage.write_bytes(f"{prefix}/{MAPPING_FILE}", vocab_mapping_to_bytes(mapping))
        write_manifest(storage, prefix, Manifest(
            kind=VOCAB_KIND, kind_version=1, files=(entry_for(prefix, written),),
            meta={**mapping.summary(), "window_steps": steps,
                  "inputs": {str(s): [[f.path, f.sha256] for f in shards[s].files]
                             for s in steps}}))
        hit = False
    result = WindowVocab(step=step, window_steps=tuple(steps), mapping=mapping, cache_key=key,
                         cache_hit=hit, uri=storage.url(prefix),
                         seconds=time.perf_counter() - started)
    write_manifest(storage, vocab_pointer_prefix(step), Manifest(  # one small PUT: no withdraw
        kind=VOCAB_POINTER_KIND, kind_version=1, files=(),
        meta={"step": step, "window": window, "window_steps": steps, "cache_key": key,
              "uri": prefix, "draft_vocab_size": mapping.draft_vocab_size,
              "target_vocab_size": mapping.target_vocab_size, "coverage": mapping.coverage}))
    return result


def load_window_vocab(storage: Storage, step: int) -> tuple[tuple[int, ...], VocabMapping]:
    """``(window_steps, mapping)`` chosen for refresh step ``step`` by the vocab stage."""
    prefix = vocab_pointer_prefix(step)
    pointer = read_manifest(storage, prefix)
    if pointer is None or pointer.kind != VOCAB_POINTER_KIND:
        raise WindowError(f"{storage.url(prefix)}: no vocab mapping for step "
                          f"{step}; materialize vocab_mapping for this partition first")
    key = meta_value(storage, prefix, pointer, "cache_key", str)
    steps = meta_value(storage, prefix, pointer, "window_steps", list)
    return tuple(steps), load_mapping(storage, key)


def load_mapping(storage: Storage, cache_key: str) -> VocabMapping:
    """The committed mapping ``vocab/<cache_key>/``, verified against its manifest."""
    prefix = mapping_prefix(cache_key)
    manifest = committed(storage, prefix, VOCAB_KIND)
    return vocab_mapping_from_bytes(read_verified(storage, prefix, manifest, MAPPING_FILE))


def _count_step(storage: Storage, step: int, manifest: Manifest, counter: TokenCounter) -> None:
    prefix = shards_prefix(step)
    for entry in manifest.files:
        with open_parquet(storage, f"{prefix}/{entry.path}") as pf:
            for batch in pf.iter_batches(columns=["input_ids", "loss_mask"]):
                ids, mask = (_flat(batch.column(c)) for c in ("input_ids", "loss_mask"))
                counter.update(ids, mask.to(torch.bool))


def _flat(column: pa.Array) -> torch.Tensor:
    """The values of a list column (slicing honoured) as a tensor (one copy, writable)."""
    return torch.from_numpy(column.flatten().to_numpy(zero_copy_only=False, writable=True))
