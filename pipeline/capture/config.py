"""How the capture stage batches and shards a step (:class:`ExtractConfig`).

Torch-free, so that Dagster run config can mirror it without loading torch with the
definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.capture.provenance import ENCODINGS

DEFAULT_TOKEN_BUDGET = 16384  # max padded tokens per backend call: B * T_max
DEFAULT_ROW_GROUP_BYTES = 64 << 20


@dataclass(frozen=True)
class ExtractConfig:
    """How a step is batched and sharded. Every field changes the bytes written."""

    token_budget: int = DEFAULT_TOKEN_BUDGET  # max padded tokens per backend call: B * T_max
    max_batch_size: int = 64
    shard_bytes: int = 512 << 20  # bf16 state bytes per shard (before compression)
    row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES
    compression: str = "zstd"  # Parquet codec: "zstd" (~20% smaller) or "none" (faster)
    sort_by_length: bool = True  # inside a shard: longest first, less padding
    heldout_fraction: float = 0.05  # prompts kept out of the shards for evaluation
    encoding: str = "bfloat16"  # bfloat16 | fp8-aux | fp8: states as float8 e4m3 + scale

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_batch_size", "shard_bytes", "row_group_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.compression not in ("zstd", "none", "lz4", "snappy"):
            raise ValueError(f"unsupported compression {self.compression!r}")
