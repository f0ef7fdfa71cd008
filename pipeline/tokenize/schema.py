"""The tokenized-rollouts contract: what tokenization writes and extraction reads.

Layout: ``tokenized/step=NNNNNN/part-*.parquet`` plus ``_manifest.json`` (kind
``tokenized_rollouts``). One row per training sample; ``loss_mask[t] = 1`` exactly on the
tokens the drafter is trained to predict (assistant/response tokens, including the tokens
that close an assistant turn).
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.formats import TOKENIZED_SCHEMA_VERSION

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
