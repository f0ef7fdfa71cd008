"""The target-model matrix: every family of :mod:`tests.families` through the production
stages — capture (hf backend) → vocab → training (DeepSpeed, a real worker process) →
export → evaluation (chain and tree) — with the lossless checks passing against the
engine's baseline and the independent cache-free reference, on prompts longer than the
sliding windows (world sequences are 16..48 tokens, windows 8).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from pipeline.capture.heldout import heldout_prompts
from pipeline.capture.shards import iter_shard
from pipeline.checks import evaluation_sound
from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.ttt_batch import LogitHead, teacher_targets
from pipeline.evaluation import stage as eval_stage
from pipeline.evaluation.config import EvalConfig
from pipeline.layout import drafter_prefix, shards_prefix
from pipeline.manifest import read_manifest
from pipeline.release.format_check import drafter_format_errors
from pipeline.training import stage as train_stage
from pipeline.training.config import TrainConfig
from pipeline.verified import fetch
from pipeline.vocab import stage as vocab_stage
from tests.families import FAMILIES, WINDOW, tiny_target
from tests.training.world import EXTRACT, build_world

pytestmark = pytest.mark.integration

STEP = 1
TRAIN = TrainConfig(lr=1e-3, warmup_ratio=0.1, micro_batch_size=4, epochs=1, ttt_depth=2,
                    threads=1, checkpoint_every=100, log_every=100, shuffle_buffer=8,
                    export_dtype="float32")
SETTINGS = {"chain": dict(num_steps=3, eagle_topk=1, num_draft_tokens=4),
            "tree": dict(num_steps=3, eagle_topk=2, num_draft_tokens=6)}


@pytest.fixture(scope="module", params=FAMILIES)
def refreshed(request, tmp_path_factory):
    """One family's world after capture, vocab and training: (storage, target, the
    training refresh, the target's checkpoint directory)."""
    torch.set_num_threads(1)
    target = tiny_target(request.param)
    root = tmp_path_factory.mktemp(request.param)
    storage = build_world(root / "storage", (STEP,), samples=16, model=target,
                          extract=replace(EXTRACT, heldout_fraction=0.3))
    vocab_stage.run(storage, STEP, 1, 64)
    refresh = train_stage.run(storage, STEP, TRAIN, work_root=root / "work",
                              warm_start="none")
    return storage, target, refresh, root / "storage-policy"  # saved by build_world


def test_the_export_is_a_drafter_of_the_target(refreshed):
    storage, target, refresh, _ = refreshed
    local = fetch(storage, drafter_prefix(STEP), kind="drafter_checkpoint", label="drafter")
    written = json.loads((local / "config.json").read_text())
    config = DrafterConfig.from_sglang_config(written)
    assert config.vocab_size == target.config.vocab_size
    assert config.aux_layer_ids == tuple(written["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"])
    assert len(set(config.aux_layer_ids)) == 3
    assert written["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in config.aux_layer_ids]
    # trained to the end on finite losses (whether a random teacher over 151,936 tokens has
    # anything to teach a 64-token draft vocab is not this test's question)
    assert refresh.result.steps > 0 and math.isfinite(refresh.result.final["loss"])


def test_capture_and_teacher_are_the_targets_own(refreshed):
    """The shards hold HF's states bit for bit (aux id l = output of layer l, final =
    post-norm), and the teacher recomputed from the final state is the target's own logits
    (tied heads, Gemma's soft-cap and all)."""
    storage, target, refresh, _ = refreshed
    prefix = shards_prefix(STEP)
    sample = next(iter_shard(storage, f"{prefix}/{read_manifest(storage, prefix).files[0].path}"))
    ids = refresh.result.drafter_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with torch.no_grad():
        out = target(input_ids=sample.input_ids.long()[None], output_hidden_states=True)
    states = out.hidden_states
    h = target.config.hidden_size
    for slot, layer in enumerate(ids):
        assert torch.equal(sample.aux_hidden[:, slot * h:(slot + 1) * h],
                           states[layer + 1][0].to(torch.bfloat16)), layer
    assert torch.equal(sample.final_hidden, states[-1][0].to(torch.bfloat16))
    every = torch.ones(target.config.vocab_size, dtype=torch.bool)
    logits, _ = teacher_targets(states[-1][0], target.get_output_embeddings().weight, every,
                                head=LogitHead.of(target.config.to_dict()))
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drafting", SETTINGS)
def test_evaluation_is_lossless_against_the_reference(refreshed, drafting):
    storage = refreshed[0]
    config = EvalConfig(max_prompts=4, max_new_tokens=12, reference_prompts=2,
                        **SETTINGS[drafting])
    report = eval_stage.run(storage, STEP, drafter_prefix(STEP), None, config)
    outcome = evaluation_sound(report)
    assert outcome.passed, outcome.description
    assert report.reference["prompts"] == 2
    assert report.contestants["candidate"].acceptance.cycles > 0
    _, prompts = heldout_prompts(storage, [STEP], config.max_prompts)
    longest = max(len(prompts[i].prompt_ids) for i in report.reference["indices"])
    assert longest + config.max_new_tokens > 2 * WINDOW  # the reference runs past windows


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A drafter of half the target's width (``drafter_hidden_size``), trained and
    published: (storage, its export, the target's checkpoint directory)."""
    root = tmp_path_factory.mktemp("narrow")
    target = tiny_target("qwen3_moe")  # hidden 64
    storage = build_world(root / "storage", (STEP,), samples=16, model=target,
                          extract=replace(EXTRACT, heldout_fraction=0.3))
    vocab_stage.run(storage, STEP, 1, 64)
    narrow = replace(TRAIN, drafter_hidden_size=32, drafter_head_dim=8)
    train_stage.run(storage, STEP, narrow, work_root=root / "work", warm_start="none")
    local = fetch(storage, drafter_prefix(STEP), kind="drafter_checkpoint", label="drafter")
    return storage, local, root / "storage-policy"


def test_a_narrower_drafter_trains_exports_and_decodes(narrow):
    """The narrow drafter owns its (projected, frozen) embedding, exports it with
    ``target_hidden_size``, passes the serving format check and decodes losslessly against
    the reference."""
    storage, local, _ = narrow
    assert drafter_format_errors(local) == ()
    written = json.loads((local / "config.json").read_text())
    assert (written["hidden_size"], written["target_hidden_size"]) == (32, 64)
    assert (written["num_attention_heads"], written["head_dim"]) == (4, 8)
    report = eval_stage.run(storage, STEP, drafter_prefix(STEP), None, EvalConfig(
        max_prompts=4, max_new_tokens=12, reference_prompts=2, **SETTINGS["tree"]))
    outcome = evaluation_sound(report)
    assert outcome.passed, outcome.description


def test_a_narrower_drafter_loads_in_vllm_speculators(narrow, speculators, tmp_path):
    _, local, target_dir = narrow
    report, error = speculators.load(local, target_dir, tmp_path / "converted")
    assert report is not None, error
    assert report["missing"] == [] and report["differing"] == []
    assert (report["hidden_size"], report["target_hidden_size"]) == (32, 64)


def test_the_export_loads_in_vllm_speculators(refreshed, speculators, tmp_path):
    """Peer loader: speculators' EAGLE-3 converter and loader take the export as it is,
    read the layers vLLM must capture, and hold every exported tensor unchanged."""
    storage, target, _, target_dir = refreshed
    local = fetch(storage, drafter_prefix(STEP), kind="drafter_checkpoint", label="drafter")
    report, error = speculators.load(local, target_dir, tmp_path / "out")
    assert report is not None, error
    assert report["missing"] == [] and report["differing"] == []
    assert report.get("current_missing", []) == report.get("current_differing", []) == []
    written = json.loads((local / "config.json").read_text())
    assert report["layer_ids"] == [i + 1 for i in written["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]]
    assert report["hidden_size"] == written["hidden_size"]
    assert report["rope_theta"] == written["rope_theta"]
    assert report["rope_type"] == (written["rope_scaling"] or {}).get("rope_type", "default")
