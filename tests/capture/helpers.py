"""What the capture tests share: the tiny Llama they capture from, random token batches,
the extraction config sized for them, and tokenized datasets written as the tokenizer stage
commits them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import LlamaForCausalLM

from pipeline.capture.config import ExtractConfig
from pipeline.capture.shards import read_shards_manifest
from pipeline.storage import Storage
from pipeline.tokenize.schema import commit_rows
from tests.families import tiny_llama as build_llama

VOCAB = 128
LENGTHS = (5, 17, 1, 9, 32, 2)
STEP = 3  # the RL step the capture tests write and extract
H = 64  # tiny_llama's default width
TOKEN_BYTES = 2 * 4 * H  # bf16 aux (3H) + final (H)
# ~6 samples per shard, 2–3 per batch, 1–2 per row group
CONFIG = ExtractConfig(token_budget=48, max_batch_size=4, shard_bytes=60 * TOKEN_BYTES,
                       row_group_bytes=24 * TOKEN_BYTES, heldout_fraction=0.0)


def tiny_llama(layers: int = 6, hidden: int = H, seed: int = 0) -> LlamaForCausalLM:
    """The capture tests' random policy (:func:`tests.families.tiny_llama` at VOCAB)."""
    return build_llama(seed, vocab=VOCAB, hidden=hidden, layers=layers)


def random_batch(lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    """Random token ids, one list per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def write_tokenized(storage: Storage, step: int, lengths: Sequence[int], seed: int = 0,
                    rows_per_part: int = 7) -> list[dict]:
    """A tokenized dataset as the tokenizer stage commits it: parts, then the manifest."""
    rng = np.random.default_rng(seed)
    rows = [{"sample_id": f"r{step}-{i}", "step": step,
             "input_ids": rng.integers(0, VOCAB, n).tolist(),
             "loss_mask": (rng.random(n) < 0.6).astype(int).tolist()}
            for i, n in enumerate(lengths)]
    return write_rows(storage, step, rows, rows_per_part)


def write_rows(storage: Storage, step: int, rows: list[dict], rows_per_part: int = 7
               ) -> list[dict]:
    """``rows`` committed as ``step``'s tokenized dataset."""
    commit_rows(storage, step, rows, rows_per_part, meta={"step": step})
    return rows


def lengths(n: int, seed: int = 0) -> list[int]:
    """``n`` sample lengths from 1 to 16."""
    return np.random.default_rng(seed).integers(1, 17, n).tolist()


def shard_files(storage: Storage) -> list[tuple[str, int, str]]:
    """``(path, bytes, sha256)`` of each shard of STEP, as its manifest lists them."""
    manifest = read_shards_manifest(storage, STEP)
    return [(f.path, f.bytes, f.sha256) for f in manifest.files]
