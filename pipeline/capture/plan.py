"""A step's extraction plan: which samples form shard ``i`` and in which batches they run.

The plan is a pure function of the tokenized order and :class:`ExtractConfig`, so every
process that extracts part of a step (``capture.parallel``) cuts the same shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from pipeline.capture.config import ExtractConfig
from pipeline.tokenize.reader import TokenizedSample


def cut_shards(samples: Iterator[TokenizedSample], tokens_per_shard: int
               ) -> Iterator[list[TokenizedSample]]:
    """Consecutive samples, a shard closing before it would exceed ``tokens_per_shard``."""
    shard: list[TokenizedSample] = []
    tokens = 0
    for s in samples:
        if shard and tokens + s.num_tokens > tokens_per_shard:
            yield shard
            shard, tokens = [], 0
        shard.append(s)
        tokens += s.num_tokens
    if shard:
        yield shard


def plan_batches(shard: list[TokenizedSample], config: ExtractConfig
                 ) -> list[list[TokenizedSample]]:
    """Batches under the token budget (``B * T_max``) and ``max_batch_size``."""
    order = sorted(shard, key=lambda s: (-s.num_tokens, s.position)) if (
        config.sort_by_length) else shard
    batches: list[list[TokenizedSample]] = []
    current: list[TokenizedSample] = []
    longest = 0
    for s in order:
        if current and ((len(current) + 1) * max(longest, s.num_tokens) > config.token_budget
                        or len(current) == config.max_batch_size):
            batches.append(current)
            current, longest = [], 0
        current.append(s)
        longest = max(longest, s.num_tokens)
    if current:
        batches.append(current)
    return batches


def shard_fingerprint(run_fp: str, index: int, batches: list[list[TokenizedSample]]) -> str:
    """What shard ``index`` of run ``run_fp`` holds: its samples, in their batches."""
    sha = hashlib.sha256(f"{run_fp}\0shard {index}\0".encode())
    for batch in batches:
        sha.update(b"\0batch\0")
        for s in batch:
            sha.update(s.sample_id.encode() + b"\0")
            sha.update(s.input_ids.tobytes() + b"\0" + s.loss_mask.tobytes())
    return sha.hexdigest()
