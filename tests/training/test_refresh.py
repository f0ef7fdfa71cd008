"""Warm start decisions, planning (lineage, fingerprints), learning on the toy, the export."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from pipeline.capture.window import WindowError
from pipeline.contracts import Manifest
from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.export import load_drafter, save_drafter
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.layout import drafter_prefix
from pipeline.manifest import entry_for, read_manifest, write_manifest
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import ServingTarget
from pipeline.training import stage as training_stage
from pipeline.training.loop import build_drafter
from pipeline.training.spec import TrainResult
from pipeline.training.stage import DRAFTER_KIND, plan, served_drafter
from pipeline.training.warmstart import apply_warm_start

from .conftest import FAST, STEP

pytestmark = pytest.mark.integration


def other_drafter(model: Eagle3Drafter, seed: int, **changes) -> Eagle3Drafter:
    config = replace(model.config, **changes)
    torch.manual_seed(seed)
    embed = torch.randn(config.vocab_size, config.hidden_size)
    return Eagle3Drafter(config, embed)


def test_a_fitting_drafter_warm_starts_and_is_recorded(vocab_storage, tmp_path):
    model = build_drafter(plan(vocab_storage, STEP, FAST, tmp_path, "none"), vocab_storage)[0]
    source = other_drafter(model, 5)
    save_drafter(source, source.config, tmp_path / "old", dtype=torch.float32)
    info = apply_warm_start(model, tmp_path / "old", "s3://x/drafters/step=000002")
    assert info["mode"] == "warm" and info["source"] == "s3://x/drafters/step=000002"
    assert torch.equal(model.fc.weight, source.fc.weight)
    assert torch.equal(model.midlayer.mlp.up_proj.weight, source.midlayer.mlp.up_proj.weight)
    # lm_head rows follow target ids: identity vocab of the source vs the window's vocab
    both = model.t2d & source.t2d
    assert info["lm_head_rows_carried"] == int(both.sum()) > 0
    assert not torch.equal(model.embed_tokens.weight, source.embed_tokens.weight)  # kept


@pytest.mark.parametrize("change,reason", [
    (dict(intermediate_size=48), "shapes differ"),
    (dict(draft_vocab_size=32), "shapes differ"),
    (dict(aux_layer_ids=(0, 1)), "shapes differ"),
    (dict(aux_layer_ids=(0, 2, 3)), "aux layer ids differ")])
def test_a_misfitting_drafter_means_scratch_with_the_reason(vocab_storage, tmp_path, change,
                                                           reason):
    model = build_drafter(plan(vocab_storage, STEP, FAST, tmp_path, "none"), vocab_storage)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    source = other_drafter(model, 5, **change)
    save_drafter(source, source.config, tmp_path / "old")
    info = apply_warm_start(model, tmp_path / "old")
    assert info["mode"] == "scratch" and reason in info["reason"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert apply_warm_start(model, None)["mode"] == "scratch"


def publish_fake_drafter(storage, step: int, model: Eagle3Drafter, tmp_path: Path) -> None:
    local = save_drafter(model, model.config, tmp_path / f"d{step}")
    prefix = drafter_prefix(step)
    written = storage.upload_dir(local, prefix)
    write_manifest(storage, prefix, Manifest(kind=DRAFTER_KIND, kind_version=1,
                                             files=tuple(entry_for(prefix, w) for w in written)))


def test_previous_warm_start_takes_the_previous_refresh_and_enters_the_fingerprint(
        vocab_storage, tmp_path):
    none = plan(vocab_storage, STEP, FAST, tmp_path, "none")
    assert plan(vocab_storage, STEP, FAST, tmp_path, "previous").warm_start_dir is None
    model = build_drafter(none, vocab_storage)[0]
    publish_fake_drafter(vocab_storage, 1, model, tmp_path)
    publish_fake_drafter(vocab_storage, 2, model, tmp_path)
    publish_fake_drafter(vocab_storage, 3, model, tmp_path)  # the step itself: not a source
    auto = plan(vocab_storage, STEP, FAST, tmp_path, "previous")
    assert "drafters/step=000002#" in auto.warm_start_source
    assert (Path(auto.warm_start_dir) / "model.safetensors").is_file()
    assert auto.fingerprint() != none.fingerprint() and auto.work_dir != none.work_dir
    explicit = plan(vocab_storage, STEP, FAST, tmp_path, str(tmp_path / "d1"))
    assert explicit.warm_start_source.startswith((tmp_path / "d1").as_uri())
    with pytest.raises(FileNotFoundError, match="neither a committed drafter"):
        plan(vocab_storage, STEP, FAST, tmp_path, "drafters/step=000009")


def test_serving_warm_start_takes_the_drafter_serving_not_the_newest_refused_one(
        vocab_storage, tmp_path):
    model = build_drafter(plan(vocab_storage, STEP, FAST, tmp_path, "none"), vocab_storage)[0]
    for step in (1, 2, 3):
        publish_fake_drafter(vocab_storage, step, model, tmp_path)
    ledger = ServingLedger(vocab_storage, "aerie-drafter-demo")

    def serve(step: int | None) -> None:
        target = None if step is None else ServingTarget(
            vocab_storage.url(drafter_prefix(step)), f"fp{step}", ledger.name, str(step))
        ledger.publish(target, SpecParams(3, 1, 4), mode="manifest", reason="test")

    assert plan(vocab_storage, STEP, FAST, tmp_path, "serving",
                ledger.name).warm_start_dir is None  # nothing ever served: scratch
    serve(1)  # drafter 2 was refused by the gate: it never served
    spec = plan(vocab_storage, STEP, FAST, tmp_path, "serving", ledger.name)
    assert "drafters/step=000001#" in spec.warm_start_source
    serve(3)  # step 3 promoted; re-running step 3 plans the same warm start
    assert served_drafter(vocab_storage, ledger.name, STEP) == 1
    assert served_drafter(vocab_storage, ledger.name, 4) == 3
    serve(None)  # a rollback to "no drafter" is not a drafter to start from
    assert served_drafter(vocab_storage, ledger.name, 4) == 3
    assert served_drafter(vocab_storage, "another-model", 4) is None
    with pytest.raises(ValueError, match="needs the serving name"):
        plan(vocab_storage, STEP, FAST, tmp_path, "serving")


def test_plan_pins_the_data_and_names_the_run_by_content(vocab_storage, tmp_path):
    a = plan(vocab_storage, STEP, FAST, tmp_path, "none")
    assert a.window_steps == (1, 2, 3) and set(a.shard_manifest_sha256) == {"1", "2", "3"}
    assert a == plan(vocab_storage, STEP, FAST, tmp_path, "none")
    assert plan(vocab_storage, STEP, replace(FAST, lr=5e-4), tmp_path, "none").work_dir != \
        a.work_dir
    assert Path(a.work_dir).name.startswith("step=000003-")


def test_a_warm_start_enters_the_fingerprint_by_its_content_alone(vocab_storage, tmp_path):
    """Not its manifest's other records (the training timings) nor where it is kept."""
    model = build_drafter(plan(vocab_storage, STEP, FAST, tmp_path, "none"), vocab_storage)[0]
    publish_fake_drafter(vocab_storage, 2, model, tmp_path)
    first = plan(vocab_storage, STEP, FAST, tmp_path, "previous")
    prefix = drafter_prefix(2)
    manifest = read_manifest(vocab_storage, prefix)
    write_manifest(vocab_storage, prefix, replace(manifest, meta={
        "result": {"seconds": 12.5, "tokens_per_s": 800.0}}))  # trained at another speed
    timed = plan(vocab_storage, STEP, FAST, tmp_path, "previous")
    elsewhere = plan(vocab_storage, STEP, FAST, tmp_path, str(tmp_path / "d2"))  # same files
    assert first.fingerprint() == timed.fingerprint() == elsewhere.fingerprint()
    assert first.warm_start_identity.startswith("sha256:")
    assert timed.superseded().fingerprint() != first.superseded().fingerprint()  # #39's bug
    other = other_drafter(model, 7)
    publish_fake_drafter(vocab_storage, 2, other, tmp_path / "other")
    assert plan(vocab_storage, STEP, FAST, tmp_path, "previous").fingerprint() != \
        first.fingerprint()


def test_a_drafter_committed_under_the_superseded_fingerprint_is_kept(vocab_storage,
                                                                      tmp_path):
    model = build_drafter(plan(vocab_storage, STEP, FAST, tmp_path, "none"), vocab_storage)[0]
    publish_fake_drafter(vocab_storage, 2, model, tmp_path)
    spec = plan(vocab_storage, STEP, FAST, tmp_path, "previous")
    old = spec.superseded().fingerprint()
    result = TrainResult(fingerprint=old, steps=4, steps_per_epoch=2, epochs=2.0, samples=8,
                         tokens_trained=100, seconds=1.0, tokens_per_s=100.0,
                         samples_per_s=8.0, resumed_from_step=None, world_size=1,
                         zero_stage=0, dtype="fp32", final={}, first={})
    publish_fake_drafter(vocab_storage, STEP, model, tmp_path / "committed")
    prefix = drafter_prefix(STEP)
    manifest = read_manifest(vocab_storage, prefix)
    write_manifest(vocab_storage, prefix, replace(manifest, meta={
        "step": STEP, "fingerprint": old, "result": asdict(result)}))
    kept = training_stage.run(vocab_storage, STEP, FAST, work_root=tmp_path / "runs")
    assert kept.reused and kept.manifest.meta["fingerprint"] == old
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_a_damaged_shard_in_the_window_stops_training_before_it_starts(vocab_storage,
                                                                       tmp_path):
    shard = sorted(Path(vocab_storage.path("shards/step=000002")).glob("*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(WindowError, match=f"step=000002/{shard.name}: sha256"):
        training_stage.run(vocab_storage, STEP, FAST, work_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # no training process was started
    assert not vocab_storage.exists(f"{drafter_prefix(STEP)}/_manifest.json")


def test_loss_falls_and_acceptance_rises_on_the_toy(reference_run):
    first, final = reference_run.first, reference_run.final
    assert final["loss"] < 0.95 * first["loss"]
    assert final["depth_loss"][0] < first["depth_loss"][0]
    assert final["sim_accept_length"] > first["sim_accept_length"]
    assert len(final["depth_accuracy"]) == FAST.ttt_depth
    assert reference_run.history[-1]["step"] == reference_run.steps == 36
    assert reference_run.tokens_per_s > 0 and reference_run.warm_start["mode"] == "scratch"


def test_the_export_is_an_sglang_drafter_with_the_window_vocab(reference_run, shared_storage):
    from pipeline.capture.window import load_target
    from pipeline.vocab.stage import load_window_vocab

    out = Path(reference_run.out_dir)
    drafter = load_drafter(out, load_target(shared_storage, STEP).embed)
    _, mapping = load_window_vocab(shared_storage, STEP)
    assert torch.equal(drafter.d2t, mapping.d2t) and torch.equal(drafter.t2d, mapping.t2d)
    config = DrafterConfig.from_sglang_config(reference_run.drafter_config)
    assert config == drafter.config and config.aux_layer_ids == (0, 1, 2)  # 4 layers
    assert drafter.fc.weight.dtype == torch.float32  # export_dtype of the test config
