"""The tokenized-rollouts contract: what tokenization writes and extraction reads.

Layout: ``tokenized/step=NNNNNN/part-*.parquet`` plus ``_manifest.json`` (kind
``tokenized_rollouts``). One row per training sample; ``loss_mask[t] = 1`` exactly on the
tokens the drafter is trained to predict (assistant/response tokens, including the tokens
that close an assistant turn).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from pipeline.contracts import Manifest
from pipeline.formats import TOKENIZED_SCHEMA_VERSION
from pipeline.layout import tokenized_prefix
from pipeline.manifest import entry_for, write_manifest
from pipeline.parquet import write_table
from pipeline.storage import Storage

TOKENIZED_KIND = "tokenized_rollouts"
TOKENIZED_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # the rollout_id
        pa.field("step", pa.int64(), nullable=False),  # RL step of the snapshot
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),  # [T]
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),  # [T], 0/1
    ],
    metadata={"aerie.kind": TOKENIZED_KIND,
              "aerie.schema_version": str(TOKENIZED_SCHEMA_VERSION)},
)


def commit_rows(storage: Storage, step: int, rows: Sequence[Mapping[str, Any]],
                rows_per_part: int = 256, meta: Mapping[str, Any] | None = None) -> int:
    """``rows`` (``sample_id``, ``step``, ``input_ids``, ``loss_mask``) committed as
    ``step``'s tokenized dataset, as the tokenizer stage commits one: parts of at most
    ``rows_per_part`` rows, then the manifest. For samples tokenized elsewhere (benchmarks,
    test worlds). Returns the number of tokens."""
    prefix, entries = tokenized_prefix(step), []
    for p in range(0, len(rows), rows_per_part):
        table = pa.Table.from_pylist(list(rows[p:p + rows_per_part]), schema=TOKENIZED_SCHEMA)
        written = write_table(storage, f"{prefix}/part-{p // rows_per_part:05d}.parquet", table)
        entries.append(entry_for(prefix, written, rows=table.num_rows))
    write_manifest(storage, prefix, Manifest(kind=TOKENIZED_KIND,
                                             kind_version=TOKENIZED_SCHEMA_VERSION,
                                             files=tuple(entries), meta=dict(meta or {})))
    return sum(len(r["input_ids"]) for r in rows)
