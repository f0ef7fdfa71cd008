"""Streaming, deterministic, resumable reader over a training window's hidden-state shards.

The unit of I/O is a Parquet row group (``(step, shard, row_group)``, sizes from the footers).
An epoch's order is fixed by ``(seed, epoch)`` alone:

1. the row groups of the window are permuted;
2. consecutive row groups are packed into *windows* of at most ``shuffle_buffer`` samples
   (a row group bigger than the buffer forms its own window);
3. the samples of each window are permuted (seed ``(seed, epoch, window)``);
4. the concatenated sequence is cut into micro batches of ``micro_batch_size`` samples;
   micro batch ``m`` belongs to rank ``m % world_size``.

Invariants:

- Same window, seed and micro batch size → the same global order for any world size; rank r
  of W sees micro batches r, r+W, …, so W ranks × B samples consume exactly what 1 rank × B
  with W-fold accumulation consumes (tested).
- Position ``(epoch, micro_batch)`` is the whole reader state: resuming there reads only the
  window that holds that micro batch's first sample (no replay of earlier data).
- Every rank reads the whole window (I/O × world_size, cheap next to training: see
  ``bench/RESULTS-training-data.md``) but hands out, and so collates, only its own micro
  batches.
- Bounded memory: one window's row groups (≤ ``max(shuffle_buffer, largest row group)``
  samples) plus at most ``micro_batch_size - 1`` carried samples, which are cloned out of the
  previous window's Arrow memory so that it can be freed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import pyarrow.parquet as pq
import torch

from pipeline.capture.shards import ShardInfo, ShardSample, read_shard_info, samples_of_batch
from pipeline.contracts import Manifest
from pipeline.layout import shards_prefix
from pipeline.parquet import open_parquet
from pipeline.storage import Storage


@dataclass(frozen=True)
class RowGroup:
    """One read unit: row group ``index`` of shard ``key`` (``rows`` samples)."""

    step: int
    key: str
    index: int
    rows: int


@dataclass(frozen=True)
class Position:
    """Where the reader stands: the next global micro batch of ``epoch``."""

    epoch: int = 0
    micro_batch: int = 0


def read_row_group(storage: Storage, unit: RowGroup, info: ShardInfo) -> list[ShardSample]:
    """The samples of one row group, as views of its Arrow memory (checksums verified)."""
    with open_parquet(storage, unit.key) as pf:
        table = pf.read_row_group(unit.index)
    url = storage.url(unit.key)
    return [s for batch in table.to_batches() for s in samples_of_batch(batch, info, url)]


def _seed(*parts: int) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _permutation(n: int, *seed_parts: int) -> list[int]:
    g = torch.Generator().manual_seed(_seed(*seed_parts))
    return torch.randperm(n, generator=g).tolist()


def _clone(s: ShardSample) -> ShardSample:
    return replace(s, input_ids=s.input_ids.clone(), loss_mask=s.loss_mask.clone(),
                   aux_hidden=s.aux_hidden.clone(), final_hidden=s.final_hidden.clone())


def truncate(s: ShardSample, max_length: int) -> ShardSample:
    """The first ``max_length`` tokens of ``s`` (views, no copy)."""
    if s.num_tokens <= max_length:
        return s
    return replace(s, input_ids=s.input_ids[:max_length], loss_mask=s.loss_mask[:max_length],
                   aux_hidden=s.aux_hidden[:max_length],
                   final_hidden=s.final_hidden[:max_length])


class WindowReader:
    """Micro batches of a window's shards in the order described in the module docstring."""

    def __init__(self, storage: Storage, manifests: Mapping[int, Manifest], *,
                 micro_batch_size: int, shuffle_buffer: int, seed: int,
                 max_length: int | None = None):
        if micro_batch_size < 1 or shuffle_buffer < 1:
            raise ValueError("micro_batch_size and shuffle_buffer must be >= 1")
        self.storage = storage
        self.micro_batch_size = micro_batch_size
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.max_length = max_length
        self.units: list[RowGroup] = []
        self._info: dict[str, ShardInfo] = {}
        for step in sorted(manifests):
            prefix = shards_prefix(step)
            for entry in manifests[step].files:
                key = f"{prefix}/{entry.path}"
                info = read_shard_info(storage, key)
                self._info[key] = info
                sizes = _row_group_sizes(storage, key)
                self.units += [RowGroup(step, key, i, n) for i, n in enumerate(sizes) if n]
        self.num_samples = sum(u.rows for u in self.units)

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.num_samples // self.micro_batch_size

    def windows(self, epoch: int) -> list[list[RowGroup]]:
        """The epoch's row groups, permuted and packed into shuffle windows."""
        order = [self.units[i] for i in _permutation(len(self.units), self.seed, epoch)]
        out: list[list[RowGroup]] = []
        rows = 0
        for unit in order:
            if out and rows + unit.rows <= self.shuffle_buffer:
                out[-1].append(unit)
                rows += unit.rows
            else:
                out.append([unit])
                rows = unit.rows
        return out

    def _load(self, units: list[RowGroup]) -> list[ShardSample]:
        return [s for u in units for s in read_row_group(self.storage, u, self._info[u.key])]

    def iter_micro_batches(self, position: Position, rank: int = 0, world_size: int = 1,
                           stop: int | None = None) -> Iterator[tuple[int, list[ShardSample]]]:
        """``(m, samples)`` for this rank's micro batches ``m`` of ``position.epoch``, from
        ``position.micro_batch`` up to ``stop`` (default: the last full micro batch)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        b = self.micro_batch_size
        stop = self.micro_batches_per_epoch if stop is None else stop
        m = position.micro_batch
        first = m * b  # global sample index of the next micro batch
        start = 0  # global sample index of the current window's first sample
        pending: list[ShardSample] = []
        for w, units in enumerate(self.windows(position.epoch)):
            if m >= stop:
                return
            size = sum(u.rows for u in units)
            if start + size <= first:  # wholly before the resume point: never read
                start += size
                continue
            samples = self._load(units)
            order = _permutation(len(samples), self.seed, position.epoch, w)
            for j in order[max(0, first - start):]:
                pending.append(samples[j])
                if len(pending) == b:
                    if m % world_size == rank:
                        yield m, [self._cut(s) for s in pending]
                    pending = []
                    m += 1
                    if m >= stop:
                        return
            start += size
            # Carry the partial micro batch out of this window's memory, then free it.
            pending = [_clone(s) for s in pending]
            del samples

    def _cut(self, s: ShardSample) -> ShardSample:
        return s if self.max_length is None else truncate(s, self.max_length)


def _row_group_sizes(storage: Storage, key: str) -> list[int]:
    with open_parquet(storage, key) as pf:
        meta: pq.FileMetaData = pf.metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
