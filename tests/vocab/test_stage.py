"""The vocab stage: masked counts over exactly the window, content-addressed cache, pointer."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.capture.window import WindowError
from pipeline.layout import mapping_prefix, tokenized_prefix, vocab_pointer_prefix
from pipeline.manifest import manifest_key, read_manifest
from pipeline.vocab import stage as vocab_stage
from pipeline.vocab.stage import load_window_vocab
from tests.training.world import VOCAB


def reference_counts(storage, steps) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts under the mask and counts of every token, row by row in Python."""
    masked = torch.zeros(VOCAB, dtype=torch.int64)
    every = torch.zeros(VOCAB, dtype=torch.int64)
    for step in steps:
        for key in storage.list(tokenized_prefix(step)):
            if not key.endswith(".parquet"):
                continue
            for row in pq.read_table(storage.local_path(key)).to_pylist():
                for tok, m in zip(row["input_ids"], row["loss_mask"], strict=True):
                    every[tok] += 1
                    masked[tok] += m
    return masked, every


def test_counts_only_masked_tokens_of_the_window(storage):
    v = vocab_stage.run(storage, 3, 2, 40)
    masked, every = reference_counts(storage, [2, 3])
    assert v.window_steps == (2, 3) and not v.cache_hit
    assert torch.equal(v.mapping.counts, masked)
    assert not torch.equal(masked, every)  # the mask matters in this data
    assert not torch.equal(masked, reference_counts(storage, [1, 2, 3])[0])  # so does the window
    top = torch.sort(masked, descending=True, stable=True).indices[:40]
    assert torch.equal(v.mapping.t2d.nonzero().flatten(), torch.sort(top).values)
    assert v.mapping.coverage == pytest.approx(int(masked[top].sum()) / int(masked.sum()))
    window, mapping = load_window_vocab(storage, 3)
    assert window == (2, 3) and torch.equal(mapping.d2t, v.mapping.d2t)


def test_rerun_hits_the_cache_and_a_size_change_misses_it(storage, monkeypatch):
    first = vocab_stage.run(storage, 3, 3, 64)

    def no_counting(*_a, **_k):
        raise AssertionError("a cache hit must not read the data")

    monkeypatch.setattr(vocab_stage, "_count_step", no_counting)
    again = vocab_stage.run(storage, 3, 3, 64)
    assert again.cache_hit and again.cache_key == first.cache_key
    assert torch.equal(again.mapping.t2d, first.mapping.t2d)
    monkeypatch.undo()
    other_draft = vocab_stage.run(storage, 3, 3, 32)
    other_target = vocab_stage.run(storage, 3, 3, 64, target_vocab_size=VOCAB + 8)
    assert not other_draft.cache_hit and not other_target.cache_hit
    assert len({first.cache_key, other_draft.cache_key, other_target.cache_key}) == 3
    assert other_target.mapping.target_vocab_size == VOCAB + 8
    assert read_manifest(storage, mapping_prefix(first.cache_key)).meta["coverage"] == \
        pytest.approx(first.mapping.coverage)
    # the pointer follows the latest materialization of the step
    pointer = read_manifest(storage, vocab_pointer_prefix(3))
    assert pointer.meta["cache_key"] == other_target.cache_key


def test_a_window_step_without_data_is_named(storage):
    with pytest.raises(WindowError, match=r"hidden-state shards for step\(s\) \[0\]"):
        vocab_stage.run(storage, 3, 4, 64)
    storage.delete(manifest_key("shards/step=000002"))
    with pytest.raises(WindowError, match=r"hidden-state shards for step\(s\) \[2\]"):
        vocab_stage.run(storage, 3, 3, 64)
    with pytest.raises(WindowError, match="materialize vocab_mapping"):
        load_window_vocab(storage, 3)
