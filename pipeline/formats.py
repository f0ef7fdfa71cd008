"""The version of each format a stage writes, in one module with no heavy import, so that
the asset definitions can name them (``assets/versions.py``) without loading torch or
pyarrow. Each stage's module re-exports its own."""

ROLLOUT_SCHEMA_VERSION = 2  # 2: speculative counters
TOKENIZED_SCHEMA_VERSION = 1
SHARD_SCHEMA_VERSION = 1  # bf16 states; shards of this layout stay v1
FP8_SCHEMA_VERSION = 2  # states may be float8 e4m3 with a per-token scale (``encoding``)
VOCAB_SCHEMA_VERSION = 1
CHECKPOINT_SCHEMA_VERSION = 1
REPORT_SCHEMA_VERSION = 4  # 2: the cache-free reference sample; 3: sampler, intervals;
# 4: the evaluator (in-process or a serving engine)
