"""Reading a committed tokenized dataset, sample by sample, in tokenized order.

The one reader of ``tokenized/step=NNNNNN/`` for the later stages (capture extracts from
it; the held-out split re-reads it for evaluation prompts). Every problem is a
:class:`TokenizedReadError` naming the file and, where it applies, the sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.contracts import Manifest
from pipeline.layout import tokenized_prefix
from pipeline.manifest import read_manifest
from pipeline.parquet import ParquetFileError, open_parquet
from pipeline.storage import Storage
from pipeline.tokenize.schema import TOKENIZED_KIND, TOKENIZED_SCHEMA

COLUMNS = ["sample_id", "step", "input_ids", "loss_mask"]


class TokenizedReadError(ValueError):
    """A committed tokenized dataset is missing or does not hold what its schema says."""


@dataclass(frozen=True, eq=False)
class TokenizedSample:
    """One sample; ``position`` is its index in the step (tokenized order)."""

    position: int
    sample_id: str
    input_ids: np.ndarray  # (T,) int32, an own writable copy
    loss_mask: np.ndarray  # (T,) int8, 0/1

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def read_tokenized_manifest(storage: Storage, step: int) -> Manifest:
    prefix = tokenized_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        raise TokenizedReadError(f"{storage.url(prefix)}: no committed tokenized samples")
    if manifest.kind != TOKENIZED_KIND:
        raise TokenizedReadError(f"{storage.url(prefix)}: manifest kind {manifest.kind!r} is "
                                 f"not {TOKENIZED_KIND!r}")
    return manifest


def iter_tokenized(storage: Storage, step: int, manifest: Manifest | None = None
                   ) -> Iterator[TokenizedSample]:
    """The step's samples in tokenized order (manifest order of ``part-*`` files)."""
    prefix = tokenized_prefix(step)
    manifest = manifest or read_tokenized_manifest(storage, step)
    position = 0
    for entry in manifest.files:
        if not (entry.path.startswith("part-") and entry.path.endswith(".parquet")):
            continue
        key = f"{prefix}/{entry.path}"
        url = storage.url(key)
        try:
            with open_parquet(storage, key) as pf:
                missing = set(COLUMNS) - set(pf.schema_arrow.names)
                if missing:
                    raise TokenizedReadError(f"{url}: missing columns {sorted(missing)}")
                for batch in pf.iter_batches(batch_size=1024, columns=COLUMNS):
                    batch = pa.RecordBatch.from_arrays(
                        [batch.column(f.name).cast(f.type) for f in TOKENIZED_SCHEMA],
                        schema=TOKENIZED_SCHEMA)
                    for sample in _samples_of(batch, url, step, position):
                        position += 1
                        yield sample
        except (pa.ArrowException, OSError) as e:
            raise TokenizedReadError(f"{url}: unreadable tokenized part ({e})") from e
        except ParquetFileError as e:
            raise TokenizedReadError(str(e)) from e


def _samples_of(batch: pa.RecordBatch, url: str, step: int, position: int
                ) -> Iterator[TokenizedSample]:
    ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
    ids_off, mask_off = ids_col.offsets.to_numpy(), mask_col.offsets.to_numpy()
    ids_all = ids_col.values.to_numpy(zero_copy_only=False)
    mask_all = mask_col.values.to_numpy(zero_copy_only=False)
    for r, (sample_id, row_step) in enumerate(zip(batch.column("sample_id").to_pylist(),
                                                  batch.column("step").to_pylist(),
                                                  strict=True)):
        ids = ids_all[ids_off[r]:ids_off[r + 1]]
        mask = mask_all[mask_off[r]:mask_off[r + 1]]
        where = f"{url}: sample {sample_id!r}"
        if row_step != step:
            raise TokenizedReadError(f"{where} has step {row_step}, expected {step}")
        if len(ids) == 0 or len(ids) != len(mask):
            raise TokenizedReadError(f"{where}: {len(ids)} input_ids vs {len(mask)} loss_mask")
        if ((mask != 0) & (mask != 1)).any():
            raise TokenizedReadError(f"{where}: loss_mask values outside 0/1")
        # Own copies (small: 5 bytes/token): the Arrow batch can go, and torch gets
        # writable arrays.
        yield TokenizedSample(position + r, sample_id, ids.astype(np.int32),
                              mask.astype(np.int8))
