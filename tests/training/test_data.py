"""The window reader: deterministic order, rank split, resume, bounded memory, clear errors;
the target weights the teacher uses."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from pipeline.capture.window import (
    WindowError,
    load_target,
    read_window,
    shard_geometry,
    window_steps,
)
from pipeline.layout import shards_prefix
from pipeline.manifest import manifest_key
from pipeline.training import data as data_mod
from pipeline.training.data import Position, WindowReader, truncate

from .world import HIDDEN, VOCAB

STEPS = [1, 2, 3]


def reader(storage, **kw) -> WindowReader:
    args = dict(micro_batch_size=4, shuffle_buffer=10, seed=0)
    args.update(kw)
    return WindowReader(storage, read_window(storage, STEPS), **args)


def ids(batches) -> list[list[str]]:
    return [[s.sample_id for s in samples] for _, samples in batches]


def test_order_is_a_seeded_permutation_that_changes_per_epoch(storage):
    r = reader(storage)
    assert r.num_samples == 96 and r.micro_batches_per_epoch == 24
    first = ids(r.iter_micro_batches(Position(0, 0)))
    again = ids(reader(storage).iter_micro_batches(Position(0, 0)))
    other_epoch = ids(r.iter_micro_batches(Position(1, 0)))
    other_seed = ids(reader(storage, seed=1).iter_micro_batches(Position(0, 0)))
    flat = [s for b in first for s in b]
    assert first == again
    assert sorted(flat) == sorted({f"s{st}-{i}" for st in STEPS for i in range(32)})
    assert flat != sorted(flat)  # shuffled, across steps
    assert {s.split("-")[0] for s in flat[:12]} != {"s1"}
    assert other_epoch != first and other_seed != first


def test_ranks_take_interleaved_micro_batches_of_the_same_global_order(storage):
    one = list(reader(storage).iter_micro_batches(Position(0, 0)))
    two = [list(reader(storage).iter_micro_batches(Position(0, 0), rank, 2)) for rank in (0, 1)]
    assert [m for m, _ in two[0]] == list(range(0, 24, 2))
    assert [m for m, _ in two[1]] == list(range(1, 24, 2))
    merged = sorted(two[0] + two[1], key=lambda x: x[0])
    assert ids(merged) == ids(one)
    for (_, a), (_, b) in zip(merged, one, strict=True):  # the same tensors, not just ids
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.aux_hidden.view(torch.int16), y.aux_hidden.view(torch.int16))


def test_resume_from_a_position_continues_the_same_order_reading_only_what_it_needs(
        storage, monkeypatch):
    r = reader(storage)
    full = ids(r.iter_micro_batches(Position(1, 0)))
    loads = []
    real = data_mod.read_row_group
    monkeypatch.setattr(data_mod, "read_row_group",
                        lambda st, unit, info: loads.append(unit) or real(st, unit, info))
    tail = ids(r.iter_micro_batches(Position(1, 17)))
    assert tail == full[17:]
    windows = r.windows(1)
    starts, total = [], 0
    for w in windows:
        starts.append(total)
        total += sum(u.rows for u in w)
    skipped = [w for w, s in zip(windows, starts, strict=True)
               if s + sum(u.rows for u in w) <= 17 * 4]
    assert skipped and not {u for w in skipped for u in w} & set(loads)
    assert ids(r.iter_micro_batches(Position(1, 5), stop=9)) == full[5:9]


def test_memory_holds_one_shuffle_window_plus_a_partial_micro_batch(storage, monkeypatch):
    alive: weakref.WeakSet = weakref.WeakSet()
    real_read, real_clone = data_mod.read_row_group, data_mod._clone

    def tracked_read(st, unit, info):
        out = real_read(st, unit, info)
        alive.update(out)
        return out

    def tracked_clone(s):
        out = real_clone(s)
        alive.add(out)
        return out

    monkeypatch.setattr(data_mod, "read_row_group", tracked_read)
    monkeypatch.setattr(data_mod, "_clone", tracked_clone)
    r = reader(storage, shuffle_buffer=10, micro_batch_size=3)
    largest = max(u.rows for u in r.units)
    assert largest <= 10
    peak = 0
    for _, batch in r.iter_micro_batches(Position(0, 0)):
        del batch
        peak = max(peak, len(alive))
    assert 0 < peak <= 10 + 3 - 1
    assert peak < r.num_samples / 3


def test_truncation_keeps_the_first_tokens_as_views(storage):
    (_, batch), *_ = reader(storage).iter_micro_batches(Position(0, 0))
    s = batch[0]
    cut = truncate(s, 5)
    assert cut.num_tokens == 5 and cut.aux_hidden.shape[0] == 5
    assert cut.input_ids.data_ptr() == s.input_ids.data_ptr()
    lengths = [x.num_tokens for _, b in reader(storage, max_length=7).iter_micro_batches(
        Position(0, 0)) for x in b]
    assert max(lengths) == 7


def test_a_missing_window_step_is_named(storage):
    assert window_steps(3, 3) == [1, 2, 3] and window_steps(1, 4) == [0, 1]
    with pytest.raises(WindowError, match=r"step\(s\) \[0\]"):
        read_window(storage, window_steps(2, 3))
    storage.delete(manifest_key(shards_prefix(2)))
    with pytest.raises(WindowError, match=r"step\(s\) \[2\]"):
        read_window(storage, STEPS)


def test_shards_of_another_convention_or_unservable_ids_are_refused(storage):
    """Training reads aux states in Aerie's convention (the output of layer l) with ids
    every engine can capture; shards saying otherwise are named, not trained on."""
    manifests = read_window(storage, STEPS)
    first = STEPS[0]
    foreign = {s: replace(m, meta={**m.meta, "aux_capture": "layer_input"}) if s == first
               else m for s, m in manifests.items()}
    with pytest.raises(WindowError, match=f"step {first}: shards hold aux states captured "
                                          "as 'layer_input'"):
        shard_geometry(foreign)
    repeated = {s: replace(m, meta={**m.meta, "aux_layer_ids": [1, 1, 0]})
                for s, m in manifests.items()}
    with pytest.raises(WindowError, match="distinct and ascending.*capture the step again"):
        shard_geometry(repeated)
    assert all(m.meta["provenance"]["engine"] == "transformers" for m in manifests.values())
    pre_norm = {s: replace(m, meta={**m.meta, "provenance": {**m.meta["provenance"],
                                                             "final_capture": "pre_norm"}})
                if s == first else m for s, m in manifests.items()}
    with pytest.raises(WindowError, match=f"step {first} shards: provenance final_capture is "
                                          "'pre_norm'.*capture the step again"):
        shard_geometry(pre_norm)


def test_window_geometry_and_target_weights_come_from_the_policy(storage, world_root):
    assert shard_geometry(read_window(storage, STEPS)) == (HIDDEN, (0, 1, 2))  # 4 layers
    target = load_target(storage, 3)
    weights = load_file(str(world_root.parent / "storage-policy" / "model.safetensors"))
    assert torch.equal(target.lm_head, weights["lm_head.weight"])
    assert torch.equal(target.embed, weights["model.embed_tokens.weight"])
    assert target.embed.shape == (VOCAB, HIDDEN)
    assert not torch.equal(target.lm_head, target.embed)


def test_tied_embeddings_serve_as_the_teacher_head(tmp_path):
    from pipeline.snapshot.policy import publish_policy
    from pipeline.storage import Storage

    from .world import tiny_target

    model = tiny_target(tie=True)
    model.save_pretrained(tmp_path / "tied")
    weights = load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert "lm_head.weight" not in weights  # transformers drops the tied copy
    storage = Storage((tmp_path / "s").as_uri())
    publish_policy(storage, 0, tmp_path / "tied")
    target = load_target(storage, 0)
    assert target.lm_head is target.embed
    assert torch.equal(target.embed, weights["model.embed_tokens.weight"])
