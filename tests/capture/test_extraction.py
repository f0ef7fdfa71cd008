"""capture.stage.run with the hf backend: content, determinism, resume, bounded memory, the
asset."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
from dagster import AssetKey, instance_for_test, materialize

from assets.shards import ShardsConfig, hidden_state_shards
from pipeline.capture import stage as capture_stage
from pipeline.capture.backends import open_backend, resolve_device
from pipeline.capture.base import CapturedStates
from pipeline.capture.config import ExtractConfig
from pipeline.capture.heldout import HeldoutSplit, heldout_prompts
from pipeline.capture.hf import HFCaptureBackend
from pipeline.capture.provenance import provenance
from pipeline.capture.shards import (
    iter_shard,
    iter_step,
    read_shard_info,
    read_shards_manifest,
)
from pipeline.capture.stage import ExtractionError
from pipeline.layout import shards_prefix, tokenized_prefix
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.retention import apply_retention
from pipeline.snapshot.policy import load_policy_ref, publish_policy
from pipeline.storage import Storage
from resources.capture import CaptureResource, HFCapture
from resources.storage import StorageResource
from tests.capture.helpers import (
    CONFIG,
    STEP,
    TOKEN_BYTES,
    VOCAB,
    H,
    lengths,
    shard_files,
    tiny_llama,
    write_rows,
    write_tokenized,
)

pytestmark = pytest.mark.integration

class Recording:
    """Wraps a backend: counts calls, can fail at call ``fail_at``, tracks live outputs."""

    def __init__(self, inner, fail_at: int | None = None):
        self.inner, self.fail_at = inner, fail_at
        self.hidden_size, self.aux_layer_ids = inner.hidden_size, inner.aux_layer_ids
        self.calls = 0
        self.batch_sizes: list[int] = []
        self._outputs: list[weakref.ref] = []
        self.max_alive = 0  # returned samples still referenced when the next call starts

    def describe(self):
        return self.inner.describe()

    def provenance(self):
        return self.inner.provenance()

    def capture(self, batch: Sequence[Sequence[int]]) -> list[CapturedStates]:
        alive = sum(r() is not None for r in self._outputs)
        self.max_alive = max(self.max_alive, alive)
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("injected crash")
        self.calls += 1
        self.batch_sizes.append(len(batch))
        out = self.inner.capture(batch)
        self._outputs = [r for r in self._outputs if r() is not None]
        self._outputs += [weakref.ref(o.aux_hidden) for o in out]
        return out


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=6, hidden=H)


def backend(model, **kw) -> Recording:
    return Recording(HFCaptureBackend(model, output_dtype=torch.bfloat16, **kw))


def test_shards_hold_every_sample_with_its_states(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    rows = write_tokenized(storage, STEP, lengths(20))
    summary = capture_stage.run(storage, STEP, backend(model), CONFIG)
    assert (summary.samples, summary.tokens) == (20, sum(len(r["input_ids"]) for r in rows))
    assert summary.loss_tokens == sum(sum(r["loss_mask"]) for r in rows)
    assert summary.shards > 2 and summary.shards_reused == 0
    assert summary.aux_layer_ids == (1, 2, 4) and summary.hidden_size == H
    manifest = read_manifest(storage, shards_prefix(STEP))
    assert manifest.kind == "hidden_state_shards" and verify_manifest(
        storage, shards_prefix(STEP), manifest) == []
    assert manifest.meta["aux_layer_ids"] == [1, 2, 4] and manifest.meta["backend"] == "hf"
    assert manifest.meta["aux_capture"] == "layer_output"
    assert manifest.meta["provenance"] == provenance("transformers", transformers.__version__,
                                                     (1, 2, 4))
    assert all(read_shard_info(storage, f"{shards_prefix(STEP)}/{f.path}").provenance
               == manifest.meta["provenance"] for f in manifest.files)
    assert [s["rows"] for s in manifest.meta["shards"]] == [f.rows for f in manifest.files]

    by_id = {r["sample_id"]: r for r in rows}
    reference = HFCaptureBackend(model)  # fp32, each sample alone
    got = list(iter_step(storage, STEP))
    assert sorted(s.sample_id for s in got) == sorted(by_id)
    for s in got:
        row = by_id[s.sample_id]
        assert s.input_ids.tolist() == row["input_ids"]
        assert s.loss_mask.tolist() == [bool(m) for m in row["loss_mask"]]
        (want,) = reference.capture([row["input_ids"]])
        torch.testing.assert_close(s.aux_hidden.float(), want.aux_hidden, rtol=0.01, atol=1e-4)
        torch.testing.assert_close(s.final_hidden.float(), want.final_hidden, rtol=0.01,
                                   atol=1e-4)


def test_shard_i_holds_a_fixed_window_of_tokenized_order_sorted_by_length(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    rows = write_tokenized(storage, STEP, lengths(20))
    capture_stage.run(storage, STEP, backend(model), CONFIG)
    seen = []
    for entry in read_shards_manifest(storage, STEP).files:
        ids = [s.sample_id for s in iter_shard(storage, f"{shards_prefix(STEP)}/{entry.path}")]
        position = {r["sample_id"]: i for i, r in enumerate(rows)}
        window = sorted(position[i] for i in ids)
        assert window == list(range(window[0], window[0] + len(ids)))  # contiguous window
        lens = [len(rows[position[i]]["input_ids"]) for i in ids]
        assert lens == sorted(lens, reverse=True)  # longest first inside the shard
        seen += window
    assert seen == list(range(20))


def test_identical_inputs_give_identical_names_and_bytes(tmp_path, model):
    results = []
    for run in ("a", "b"):
        storage = Storage((tmp_path / run).as_uri())
        write_tokenized(storage, STEP, lengths(20))
        capture_stage.run(storage, STEP, backend(model), CONFIG)
        results.append(shard_files(storage))
    assert results[0] == results[1] and len(results[0]) > 2


def test_a_step_tokenized_again_with_other_rows_is_captured_again(tmp_path, model):
    """A rewritten snapshot step (the snapshot sensor ingests it again) is tokenized again;
    the committed shards of the first write must not be kept for the second."""
    storage = Storage((tmp_path / "s").as_uri())
    write_tokenized(storage, STEP, lengths(20))
    capture_stage.run(storage, STEP, backend(model), CONFIG)
    first = shard_files(storage)
    rows = write_tokenized(storage, STEP, lengths(12, seed=5), seed=5)
    again = backend(model)
    summary = capture_stage.run(storage, STEP, again, CONFIG)
    assert again.calls > 0 and summary.shards_reused == 0
    assert shard_files(storage) != first
    captured = sorted(s.sample_id for e in read_shards_manifest(storage, STEP).files
                      for s in iter_shard(storage, f"{shards_prefix(STEP)}/{e.path}"))
    assert captured == sorted(r["sample_id"] for r in rows)


def test_resume_after_a_crash_keeps_finished_shards(tmp_path, model):
    clean = Storage((tmp_path / "clean").as_uri())
    write_tokenized(clean, STEP, lengths(20))
    full = backend(model)
    capture_stage.run(clean, STEP, full, CONFIG)

    storage = Storage((tmp_path / "crash").as_uri())
    write_tokenized(storage, STEP, lengths(20))
    crashed = Recording(full.inner, fail_at=5)  # mid-way: each shard takes 2–3 batches
    with pytest.raises(RuntimeError, match="injected crash"):
        capture_stage.run(storage, STEP, crashed, CONFIG)
    assert read_manifest(storage, shards_prefix(STEP)) is None  # nothing committed
    done = [k for k in storage.list(shards_prefix(STEP)) if k.endswith(".parquet")]
    assert 1 <= len(done) < len(shard_files(clean))

    again = backend(model)
    summary = capture_stage.run(storage, STEP, again, CONFIG)
    assert summary.shards_reused == len(done) and summary.backend_calls == again.calls
    kept_rows = sum(s["rows"] for s in read_shards_manifest(storage, STEP).meta["shards"][
        :len(done)])
    kept_batches = int(np.searchsorted(np.cumsum(full.batch_sizes), kept_rows)) + 1
    assert sum(full.batch_sizes[:kept_batches]) == kept_rows
    assert again.calls == full.calls - kept_batches  # only the unfinished shards ran
    assert shard_files(storage) == shard_files(clean)  # byte-identical result


def test_a_committed_step_is_not_recomputed(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, lengths(8))
    first = capture_stage.run(storage, STEP, backend(model), CONFIG)
    again = backend(model)
    second = capture_stage.run(storage, STEP, again, CONFIG)
    assert again.calls == 0 and second.already_committed
    assert (second.samples, second.bytes, second.shards) == (first.samples, first.bytes,
                                                              first.shards)


def test_a_step_deleted_by_retention_is_extracted_again_to_the_same_bytes(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, lengths(8))
    first = capture_stage.run(storage, STEP, backend(model), CONFIG)
    files = shard_files(storage)
    assert apply_retention(storage, STEP + 4, 2).deleted_steps == (STEP,)
    again = backend(model)
    second = capture_stage.run(storage, STEP, again, CONFIG)
    assert again.calls > 0 and not second.already_committed and second.shards_reused == 0
    assert shard_files(storage) == files and second.bytes == first.bytes
    assert "deleted" not in read_shards_manifest(storage, STEP).meta
    assert sum(1 for _ in iter_step(storage, STEP)) == 8


def test_fp8_encoding_is_a_configuration_its_manifest_and_provenance_say_so(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, lengths(8))
    bf16 = capture_stage.run(storage, STEP, backend(model), CONFIG)
    reference = {s.sample_id: s.aux_hidden.clone() for s in iter_step(storage, STEP)}
    fp8 = capture_stage.run(storage, STEP, backend(model), replace(CONFIG, encoding="fp8"))
    manifest = read_shards_manifest(storage, STEP)
    assert (fp8.schema_version, manifest.kind_version, manifest.meta["encoding"]) == (
        2, 2, "fp8")
    assert manifest.meta["provenance"]["encoding"] == "fp8"
    assert fp8.bytes < 0.75 * bf16.bytes and not fp8.already_committed
    for s in iter_step(storage, STEP):
        want = reference[s.sample_id].float()
        scale = want.abs().amax(dim=1, keepdim=True)
        assert bool(((s.aux_hidden.float() - want).abs() <= scale / 16).all())


def test_a_damaged_committed_shard_is_re_extracted_alone(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, lengths(20))
    first = capture_stage.run(storage, STEP, backend(model), CONFIG)
    clean = shard_files(storage)
    prefix = shards_prefix(STEP)
    shard1 = storage.local_path(f"{prefix}/shard-00001.parquet")
    shard1.write_bytes(shard1.read_bytes()[:-1] + b"!")  # rotted after the commit
    again = backend(model)
    summary = capture_stage.run(storage, STEP, again, CONFIG)
    assert not summary.already_committed and 0 < again.calls
    assert summary.shards_reused == first.shards - 1  # only shard 1 was extracted again
    assert verify_manifest(storage, prefix, read_manifest(storage, prefix)) == []
    assert shard_files(storage) == clean


def test_another_configuration_rebuilds_and_recommits(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, lengths(8))
    capture_stage.run(storage, STEP, backend(model), CONFIG)
    before = shard_files(storage)
    other = backend(model, aux_layer_ids=(0, 3, 4))
    summary = capture_stage.run(storage, STEP, other, CONFIG)
    assert other.calls > 0 and summary.shards_reused == 0
    assert summary.aux_layer_ids == (0, 3, 4)
    assert shard_files(storage) != before
    assert read_shards_manifest(storage, STEP).meta["aux_layer_ids"] == [0, 3, 4]


def test_leftovers_of_a_crash_are_checked_not_trusted(tmp_path, model):
    clean = Storage((tmp_path / "clean").as_uri())
    write_tokenized(clean, STEP, lengths(20))
    capture_stage.run(clean, STEP, backend(model), CONFIG)
    storage = Storage((tmp_path / "crash").as_uri())
    write_tokenized(storage, STEP, lengths(20))
    with pytest.raises(RuntimeError):
        capture_stage.run(storage, STEP, Recording(backend(model).inner, fail_at=5), CONFIG)
    prefix = shards_prefix(STEP)
    shard0 = storage.local_path(f"{prefix}/shard-00000.parquet")
    shard0.write_bytes(shard0.read_bytes()[:-1] + b"!")  # changed after its marker
    storage.local_path(f"{prefix}/_progress/shard-00001.parquet.json").unlink()  # died
    # between publishing shard 1 and its marker; and a hard kill left a temp file behind:
    storage.local_path(f"{prefix}/.shard-00002.parquet.dead.tmp").write_bytes(b"partial")
    summary = capture_stage.run(storage, STEP, backend(model), CONFIG)
    assert summary.shards_reused == 0
    assert verify_manifest(storage, prefix, read_manifest(storage, prefix)) == []
    assert shard_files(storage) == shard_files(clean)


@pytest.mark.parametrize("scale", [1, 4])
def test_memory_is_bounded_by_a_row_group_not_the_step(tmp_path, model, scale):
    """Captured states held when the next batch starts: at most one row group's rows."""
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, [8] * 12 * scale)
    rec = backend(model)
    capture_stage.run(storage, STEP, rec, CONFIG)
    rows_per_group = CONFIG.row_group_bytes // (8 * TOKEN_BYTES)  # 3
    assert max(rec.batch_sizes) <= CONFIG.max_batch_size
    assert 1 <= rec.max_alive <= rows_per_group
    assert rec.calls >= 12 * scale // CONFIG.max_batch_size


def test_broken_backend_output_is_refused(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    write_tokenized(storage, STEP, lengths(6))
    inner = HFCaptureBackend(model)

    class Broken(Recording):
        def capture(self, batch):
            out = inner.capture(batch)
            aux = out[0].aux_hidden.clone()
            aux[0, 0] = float("nan")
            return [CapturedStates(aux, out[0].final_hidden), *out[1:]]

    with pytest.raises(ExtractionError, match="non-finite"):
        capture_stage.run(storage, STEP, Broken(inner), CONFIG)

    class Short(Recording):
        def capture(self, batch):
            return [CapturedStates(s.aux_hidden[:-1], s.final_hidden)
                    for s in inner.capture(batch)]

    with pytest.raises(ExtractionError, match="shape"):
        capture_stage.run(storage, STEP, Short(inner), CONFIG)
    assert read_manifest(storage, shards_prefix(STEP)) is None


def test_missing_or_corrupt_input_is_named(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    with pytest.raises(ExtractionError, match="no committed tokenized"):
        capture_stage.run(storage, STEP, backend(model), CONFIG)
    write_tokenized(storage, STEP, lengths(6))
    part = storage.local_path(f"{tokenized_prefix(STEP)}/part-00000.parquet")
    part.write_bytes(part.read_bytes() + b"x")
    with pytest.raises(ExtractionError, match="part-00000.parquet"):
        capture_stage.run(storage, STEP, backend(model), CONFIG)


# -- the asset --------------------------------------------------------------------------
def test_auto_device_is_the_gpu_when_there_is_one_and_a_missing_gpu_is_named():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="capture device 'cuda:0': torch sees 0 CUDA"):
            resolve_device("cuda:0")
    with pytest.raises(ValueError, match="capture device 'cuda:99': torch sees"):
        resolve_device("cuda:99")


def test_dagster_config_mirrors_the_core_config():
    core = ShardsConfig().to_core()
    assert core == ExtractConfig()
    assert set(ExtractConfig.__dataclass_fields__) <= set(ShardsConfig.model_fields)


def test_asset_materializes_a_step_with_its_own_policy(tmp_path, model):
    url = (tmp_path / "storage").as_uri()
    storage = Storage(url)
    model.save_pretrained(tmp_path / "policy")
    publish_policy(storage, STEP, tmp_path / "policy")
    write_tokenized(storage, STEP, lengths(10))
    run_config = {"ops": {"hidden_state_shards": {"config": {
        "token_budget": 48, "shard_bytes": 60 * TOKEN_BYTES}}}}
    resources = {"storage": StorageResource(url=url),
                 "capture": CaptureResource(aux_layer_ids=[0, 2, 4], hf=HFCapture(device="auto"))}
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", ["step-000003"])
        result = materialize([hidden_state_shards], partition_key="step-000003",
                             instance=instance, resources=resources, run_config=run_config)
        assert result.success
        (event,) = result.get_asset_materialization_events()
        meta = {k: v.value for k, v in event.materialization.metadata.items()}
        assert instance.get_materialized_partitions(AssetKey("hidden_state_shards")) == {
            "step-000003"}
    manifest = read_shards_manifest(storage, STEP)
    assert meta["uri"] == storage.url(shards_prefix(STEP))
    assert (meta["samples"], meta["shards"], meta["bytes"]) == (
        10, len(manifest.files), manifest.total_bytes)
    assert meta["aux_layer_ids"] == [0, 2, 4] and meta["hidden_size"] == H
    assert meta["backend"] == "hf" and meta["schema_version"] == 1
    assert meta["provenance"]["engine"] == "transformers"
    assert meta["bytes_per_token"] == pytest.approx(manifest.total_bytes / meta["tokens"], 0.01)
    policy = load_policy_ref(storage, STEP)
    assert manifest.meta["policy_sha256"] == policy.sha256
    assert manifest.meta["policy_uri"] == policy.key == "policies/step=000003"  # movable
    assert manifest.meta["backend_config"]["model_dtype"] == "float32"
    run_config["ops"]["hidden_state_shards"]["config"]["encoding"] = "fp8-aux"  # run config
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", ["step-000003"])
        result = materialize([hidden_state_shards], partition_key="step-000003",
                             instance=instance, resources=resources, run_config=run_config)
        (event,) = result.get_asset_materialization_events()
        meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["schema_version"] == 2 and meta["provenance"]["encoding"] == "fp8-aux"
    assert read_shards_manifest(storage, STEP).meta["encoding"] == "fp8-aux"


def test_open_backend_refuses_unknown_kinds_and_builds_sglang_from_the_policy(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    model.save_pretrained(tmp_path / "policy")
    publish_policy(storage, STEP, tmp_path / "policy")
    with pytest.raises(ValueError, match="unknown capture backend"):
        with open_backend(storage, STEP, "tensorrt-llm"):
            pass
    with open_backend(storage, STEP, "sglang", options={
            "aux_urls": ["http://127.0.0.1:9"], "final_urls": ["http://127.0.0.1:9"]}) as sglang:
        assert sglang.hidden_size == H and sglang.aux_layer_ids == (1, 2, 4)


def test_heldout_prompts_never_reach_the_shards(tmp_path, model):
    storage = Storage(tmp_path.as_uri())
    rng = np.random.default_rng(3)
    rows = []
    for p in range(12):  # RL groups: 3 samples share a prompt, responses differ
        prompt = rng.integers(0, VOCAB, 3 + p % 4).tolist()
        for k in range(3):
            response = rng.integers(0, VOCAB, 2 + k).tolist()
            rows.append({"sample_id": f"p{p}-{k}", "step": STEP,
                         "input_ids": prompt + response,
                         "loss_mask": [0] * len(prompt) + [1] * len(response)})
    write_rows(storage, STEP, rows)
    split = HeldoutSplit(0.3)
    held = {r["sample_id"] for r in rows
            if split.holds_out(np.array(r["input_ids"]), np.array(r["loss_mask"]))}
    assert 0 < len(held) < len(rows) and len(held) % 3 == 0  # whole groups
    summary = capture_stage.run(storage, STEP, backend(model),
                                replace(CONFIG, heldout_fraction=0.3))
    got = {s.sample_id for s in iter_step(storage, STEP)}
    assert got == {r["sample_id"] for r in rows} - held
    assert summary.heldout == len(held) and summary.samples == len(rows) - len(held)
    meta = read_shards_manifest(storage, STEP).meta["heldout"]
    assert meta == {"fraction": 0.3, "salt": split.salt, "samples": len(held)}

    # Evaluation finds exactly those prompts (one per group), in key order, cut at max.
    used, prompts = heldout_prompts(storage, [STEP], max_prompts=100)
    assert used == split
    expect = {tuple(r["input_ids"][:r["loss_mask"].index(1)]) for r in rows
              if r["sample_id"] in held}
    assert {p.prompt_ids for p in prompts} == expect and len(prompts) == len(held) // 3
    assert [p.key for p in prompts] == sorted(p.key for p in prompts)
    assert heldout_prompts(storage, [STEP], max_prompts=2)[1] == prompts[:2]
