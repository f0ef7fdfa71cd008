"""The target-model matrix: every family of :mod:`tests.families` through the production
stages — capture (hf backend) → vocab → training (DeepSpeed, a real worker process) →
export → evaluation (chain and tree) — with the lossless checks passing against the
engine's baseline and the independent cache-free reference, on prompts longer than the
sliding windows (world sequences are 16..48 tokens, windows 8).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.algorithms import algorithm, algorithm_of_directory, format_errors
from pipeline.capture.config import ExtractConfig
from pipeline.capture.heldout import heldout_prompts
from pipeline.capture.hf import HFCaptureBackend
from pipeline.capture.plan import plan_batches, shard_fingerprint
from pipeline.capture.shards import ShardSample, iter_shard, shard_name
from pipeline.checks import evaluation_sound
from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.ttt_batch import LogitHead, teacher_targets
from pipeline.evaluation import stage as eval_stage
from pipeline.evaluation.config import EvalConfig
from pipeline.layout import drafter_prefix, shards_prefix
from pipeline.manifest import Manifest, read_manifest
from pipeline.tokenize.reader import TokenizedSample
from pipeline.training import stage as train_stage
from pipeline.training.config import TrainConfig
from pipeline.verified import fetch
from pipeline.vocab import stage as vocab_stage
from tests.families import FAMILIES, WINDOW, tiny_target
from tests.training.world import EXTRACT, build_world

pytestmark = pytest.mark.integration  # a DeepSpeed worker process trains each world

STEP = 1
TRAIN = TrainConfig(lr=1e-3, warmup_ratio=0.1, micro_batch_size=4, epochs=1, ttt_depth=2,
                    threads=1, checkpoint_every=100, log_every=100, shuffle_buffer=8,
                    export_dtype="float32")
NARROW = replace(TRAIN, drafter_hidden_size=32, drafter_head_dim=8)
V31 = replace(TRAIN, drafter_algorithm="eagle3.1")
V31_WORLDS = ("eagle3.1:llama3", "eagle3.1:qwen3_moe", "eagle3.1:mistral_window")
DFLASH = replace(TRAIN, drafter_algorithm="dflash", dflash_layers=2, dflash_block_size=4,
                 dflash_anchors=16)
DFLASH_WORLDS = ("dflash:llama3", "dflash:qwen3_moe", "dflash:mistral_window")
SETTINGS = {"chain": dict(num_steps=3, eagle_topk=1, num_draft_tokens=4),
            "tree": dict(num_steps=3, eagle_topk=2, num_draft_tokens=6)}


# worlds prepared at once: a training is a DeepSpeed process on one thread that spends most
# of its ~12 s importing, so preparing one world at a time left one of CI's 2 cores idle
LANES = 2


def _prepare(target, root: Path, config: TrainConfig = TRAIN) -> tuple:
    """A world of ``target`` under ``root`` after capture (of the layers the trained
    algorithm reads by default; for DFlash, EAGLE-3's too), vocab and training: (storage,
    target, the training refresh, the target's checkpoint directory)."""
    torch.set_num_threads(1)  # this thread's torch: the captures stay one-threaded
    layers, kind = target.config.num_hidden_layers, target.config.model_type
    ids = algorithm(config.drafter_algorithm).default_layer_ids(layers, kind)
    if config.drafter_algorithm == "dflash":  # a window captured for EAGLE-3 and DFlash both:
        # the drafter trains on its own layers among them
        ids = tuple(sorted({*ids, *algorithm("eagle3").default_layer_ids(layers, kind)}))
    storage = build_world(root / "storage", (STEP,), samples=16, model=target,
                          extract=replace(EXTRACT, heldout_fraction=0.3), aux_layer_ids=ids)
    vocab_stage.run(storage, STEP, 1, 64)
    refresh = train_stage.run(storage, STEP, config, work_root=root / "work",
                              warm_start="none")
    return storage, target, refresh, root / "storage-policy"  # saved by build_world


def _worlds_used(request) -> list[str]:
    """The worlds the selected tests of this module use (a family, or ``narrow``), in the
    order they run."""
    used: dict[str, None] = {}
    for item in request.session.items:
        if item.module is request.module and "refreshed" in item.fixturenames:
            used[item.callspec.params["refreshed"]] = None
        elif item.module is request.module and "refreshed_v31" in item.fixturenames:
            used[item.callspec.params["refreshed_v31"]] = None
        elif item.module is request.module and "refreshed_dflash" in item.fixturenames:
            used[item.callspec.params["refreshed_dflash"]] = None
        elif item.module is request.module and "narrow" in item.fixturenames:
            used["narrow"] = None
    return list(used)


@pytest.fixture(scope="module")
def prepared(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """The worlds of the selected tests, prepared :data:`LANES` at a time in the background
    from the module's first test on, in the order the tests use them. The targets are built
    here, one after the other: their seeded initialisation draws from torch's global
    generator, which threads would share."""
    torch.set_num_threads(1)
    with ThreadPoolExecutor(max_workers=LANES) as lanes:
        worlds = {}
        for name in _worlds_used(request):
            if name == "narrow":
                target, config = tiny_target("qwen3_moe"), NARROW  # H 64
            elif name.startswith("eagle3.1:"):
                target, config = tiny_target(name.removeprefix("eagle3.1:")), V31
            elif name.startswith("dflash:"):
                target, config = tiny_target(name.removeprefix("dflash:")), DFLASH
            else:
                target, config = tiny_target(name), TRAIN
            worlds[name] = lanes.submit(_prepare, target, tmp_path_factory.mktemp(name),
                                        config)
        yield worlds
        for world in worlds.values():
            world.cancel()  # those not started yet, when the module stops early


@pytest.fixture(scope="module", params=FAMILIES)
def refreshed(request, prepared):
    """One family's world after capture, vocab and training: (storage, target, the
    training refresh, the target's checkpoint directory)."""
    return prepared[request.param].result()


@pytest.fixture(scope="module", params=V31_WORLDS)
def refreshed_v31(request, prepared):
    """An EAGLE 3.1 drafter (``drafter_algorithm: eagle3.1``) trained on a world of Llama,
    Qwen3 (MoE) or a sliding-window target, like :func:`refreshed`."""
    return prepared[request.param].result()


@pytest.fixture(scope="module", params=DFLASH_WORLDS)
def refreshed_dflash(request, prepared):
    """A DFlash drafter (``drafter_algorithm: dflash``, a block of 4) trained on a world of
    Llama, Qwen3 (MoE) or a sliding-window target whose capture recorded DFlash's layers."""
    return prepared[request.param].result()


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


# the hf backend right-pads every batch with its pad id (build_world keeps the default)
PAD = inspect.signature(HFCaptureBackend).parameters["pad_token_id"].default
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: one bf16 ulp is at most eps * |x|


def _capture_batches(storage, prefix: str, manifest: Manifest, name: str
                     ) -> list[list[ShardSample]]:
    """Shard ``name``'s rows in the batches the capture ran them in.

    The capture writes a shard's rows batch after batch, in the order ``plan_batches``
    gave them (longest first, ties in tokenized order), so planning the rows again in
    their stored order, with the shard's recorded :class:`ExtractConfig`, cuts the same
    batches; the shard's recorded fingerprint (its samples, in their batches) proves it.
    """
    rows = list(iter_shard(storage, f"{prefix}/{name}"))
    planned = [TokenizedSample(position=i, sample_id=r.sample_id,
                               input_ids=r.input_ids.numpy(),
                               loss_mask=r.loss_mask.numpy().view("int8"))
               for i, r in enumerate(rows)]
    batches = plan_batches(planned, ExtractConfig(**manifest.meta["config"]))
    index = int(name.removeprefix("shard-").removesuffix(".parquet"))
    assert shard_name(index) == name
    recorded = {s["path"]: s["fingerprint"] for s in manifest.meta["shards"]}[name]
    assert shard_fingerprint(manifest.meta["fingerprint"], index, batches) == recorded
    by_position = dict(enumerate(rows))
    return [[by_position[s.position] for s in batch] for batch in batches]


def _padded_forward(target, batch: list[ShardSample]) -> tuple[torch.Tensor, ...]:
    """HF's own ``output_hidden_states`` of ``batch`` as the hf backend runs a batch: the
    same rows, right-padded with its pad id, masked, no KV cache, fp32 (in one forward:
    build_world gives the backend the plan's ``token_budget``, so it splits no batch)."""
    t_max = max(s.num_tokens for s in batch)
    ids = torch.full((len(batch), t_max), PAD, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(batch):
        ids[row, :s.num_tokens] = s.input_ids.long()
        mask[row, :s.num_tokens] = 1
    with torch.no_grad():
        return target(input_ids=ids, attention_mask=mask, use_cache=False,
                      output_hidden_states=True).hidden_states


def test_capture_and_teacher_are_the_targets_own(refreshed):
    """The shards hold transformers' own states (aux id l = output of layer l, HF
    ``hidden_states[l + 1]``; final = ``hidden_states[-1]``, post-norm), and the teacher
    recomputed from the final state is the target's own logits (tied heads, Gemma's
    soft-cap and all).

    Bit for bit (``torch.equal``), on any CPU: every row of the first shard against
    ``target(..., output_hidden_states=True)`` run in the capture's own batch plan (the
    batch the row was captured in, recut with ``plan_batches`` and checked against the
    shard's fingerprint, right-padded and masked as the backend pads it, fp32, then
    rounded to bf16 as the shard stores it). Only that reference is exact: the same
    shapes give the same kernels and the same reduction order on the machine running both.

    Within bf16 rounding: the same rows against a plain unbatched forward of each sample
    alone. Its fp32 states differ from the batch's in the last bits (matmul reductions are
    blocked by the batch's shape and the CPU's SIMD width, and the MoE families run each
    expert on the tokens routed to it, padding included, so the batch changes the experts'
    matmul shapes; a reference run of DeepSeek-V3 alone differs in layer 3, its first MoE
    layer, on AMD EPYC), and a last-bit difference can round to the neighbouring bf16
    value. So: at most one bf16 ulp (``rtol`` = bf16 eps, 2**-7), plus an absolute 1e-4
    for values near zero, where the fp32 difference (about 1e-6 here) is not small
    relative to the value; a wrong layer, a shifted row or a missing norm is off by O(1).
    The teacher is checked against the unbatched forward's own logits, computed from its
    own final state (no rounding between them: 1e-5).
    """
    storage, target, refresh, _ = refreshed
    prefix = shards_prefix(STEP)
    manifest = read_manifest(storage, prefix)
    batches = _capture_batches(storage, prefix, manifest, manifest.files[0].path)
    ids = refresh.result.drafter_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    h = target.config.hidden_size

    def slots(states: tuple[torch.Tensor, ...], row: int, n: int) -> list[torch.Tensor]:
        """The aux slots then the final state of ``row``'s first ``n`` tokens, as bf16."""
        return [states[layer + 1][row, :n].to(torch.bfloat16) for layer in ids] + [
            states[-1][row, :n].to(torch.bfloat16)]

    for batch in batches:
        batched = _padded_forward(target, batch)
        for row, sample in enumerate(batch):
            n = sample.num_tokens
            stored = [sample.aux_hidden[:, slot * h:(slot + 1) * h]
                      for slot in range(len(ids))] + [sample.final_hidden]
            with torch.no_grad():
                alone = target(input_ids=sample.input_ids.long()[None],
                               output_hidden_states=True).hidden_states
            for what, got, exact, near in zip([*ids, "final"], stored,
                                              slots(batched, row, n), slots(alone, 0, n),
                                              strict=True):
                assert torch.equal(got, exact), (sample.sample_id, what)
                torch.testing.assert_close(got.float(), near.float(), rtol=BF16_EPS,
                                           atol=1e-4, msg=lambda m, w=what: f"{w}: {m}")

    sample = batches[0][0]
    with torch.no_grad():
        out = target(input_ids=sample.input_ids.long()[None], output_hidden_states=True)
    every = torch.ones(target.config.vocab_size, dtype=torch.bool)
    logits, _ = teacher_targets(out.hidden_states[-1][0], target.get_output_embeddings().weight,
                                every, head=LogitHead.of(target.config.to_dict()))
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
def narrow(prepared):
    """A drafter of half the width of its target (qwen3_moe, hidden 64), trained and
    published: (storage, its export, the target's checkpoint directory)."""
    storage, _, _, target_dir = prepared["narrow"].result()
    local = fetch(storage, drafter_prefix(STEP), kind="drafter_checkpoint", label="drafter")
    return storage, local, target_dir


def test_a_narrower_drafter_trains_exports_and_decodes(narrow):
    """The narrow drafter owns its (projected, frozen) embedding, exports it with
    ``target_hidden_size``, passes the serving format check and decodes losslessly against
    the reference."""
    storage, local, _ = narrow
    assert format_errors(local) == ()
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


@pytest.mark.parametrize("drafting", SETTINGS)
def test_an_eagle31_drafter_trains_exports_and_decodes_losslessly(refreshed_v31, drafting):
    """Chosen in the run config, trained with its norms, exported with the keys both engines
    read (and its fc_norm tensors, which the format check demands), and decoded by the
    in-process engine losslessly against the reference."""
    storage, target, refresh, _ = refreshed_v31
    assert refresh.result.steps > 0 and math.isfinite(refresh.result.final["loss"])
    local = fetch(storage, drafter_prefix(STEP), kind="drafter_checkpoint", label="drafter")
    written = json.loads((local / "config.json").read_text())
    assert (written["fc_norm"], written["norm_output"]) == (True, True)
    assert algorithm_of_directory(local).name == "eagle3.1" and format_errors(local) == ()
    norms = load_file(str(local / "model.safetensors"))
    assert [tuple(norms[f"fc_norm.{i}.weight"].shape) for i in range(3)] == \
        [(target.config.hidden_size,)] * 3
    trained = [norms[f"fc_norm.{i}.weight"] for i in range(3)]
    assert all(not torch.equal(w, torch.ones_like(w)) for w in trained)  # moved off init
    config = EvalConfig(max_prompts=4, max_new_tokens=12, reference_prompts=2,
                        **SETTINGS[drafting])
    report = eval_stage.run(storage, STEP, drafter_prefix(STEP), None, config)
    outcome = evaluation_sound(report)
    assert outcome.passed, outcome.description
    assert report.contestants["candidate"].acceptance.cycles > 0


def test_a_dflash_drafter_trains_exports_and_decodes_losslessly(refreshed_dflash):
    """Chosen in the run config, trained with the block loss on the layers the capture
    recorded for it, exported as both engines' DFlash loaders read it (no embedding, no
    head), and decoded by the in-process engine losslessly against the reference."""
    storage, target, refresh, _ = refreshed_dflash
    assert refresh.result.steps > 0 and math.isfinite(refresh.result.final["loss"])
    assert len(refresh.result.final["depth_accuracy"]) == 3  # block 4: three draft slots
    local = fetch(storage, drafter_prefix(STEP), kind="drafter_checkpoint", label="drafter")
    written = json.loads((local / "config.json").read_text())
    n = target.config.num_hidden_layers
    assert written["dflash_config"]["target_layer_ids"] == \
        list(algorithm("dflash").default_layer_ids(n, target.config.model_type))
    assert (written["block_size"], written["num_target_layers"]) == (4, n)
    assert algorithm_of_directory(local).name == "dflash" and format_errors(local) == ()
    names = load_file(str(local / "model.safetensors"))
    assert "lm_head.weight" not in names and "d2t" not in names
    config = EvalConfig(max_prompts=4, max_new_tokens=12, reference_prompts=2,
                        **SETTINGS["chain"])
    report = eval_stage.run(storage, STEP, drafter_prefix(STEP), None, config)
    outcome = evaluation_sound(report)
    assert outcome.passed, outcome.description
    assert report.contestants["candidate"].acceptance.cycles > 0


def test_dflash_is_refused_before_training_for_a_family_no_engine_drafts_it_for(tmp_path):
    target = tiny_target("gemma2")
    storage = build_world(tmp_path / "storage", (STEP,), samples=4, model=target)
    vocab_stage.run(storage, STEP, 1, 64)
    with pytest.raises(ValueError, match=r"step 1: cannot train a dflash drafter for this "
                                         r"policy: DFlash cannot be served for a 'gemma2'"):
        train_stage.plan(storage, STEP, DFLASH, tmp_path / "work", "none")
    assert not (tmp_path / "work").exists()  # nothing launched
