"""DFlash: its config as the engines read it, its block in training and in drafting against
the equations written out, its export, its serving flags, and its loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.algorithms import (
    algorithm,
    algorithm_of_directory,
    as_drafter,
    format_errors,
    trained_layers,
)
from pipeline.dflash.config import DFlashConfig, default_target_layer_ids
from pipeline.dflash.export import load_drafter, save_drafter, warm_start_from
from pipeline.dflash.objective import BlockBatch, block_loss, lay_out, valid_anchors
from pipeline.dflash.proposer import DFlashProposer
from pipeline.dflash.reference import block_logits
from pipeline.drafters.protocol import ROOT, CandidateTree
from pipeline.eagle3.spec import SpecParams
from pipeline.serving_now import serving_args, vllm_speculative_config
from pipeline.training.loop import layer_columns
from tests.dflash.helpers import VOCAB, tiny_dflash, tiny_target_config

T = 20


def test_the_engines_default_layers_and_the_config_they_read():
    assert default_target_layer_ids(36) == (1, 9, 17, 25, 33)  # Qwen3-8B, as both derive
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(4) == (0, 1, 2)  # too shallow to spread: every layer
    cfg = DFlashConfig.from_target(tiny_target_config(), layers=3, block_size=6)
    assert (cfg.target_layer_ids, cfg.mask_token_id, cfg.draft_tokens) == ((1, 3, 5), 47, 5)
    written = cfg.to_config_json()
    assert written["architectures"] == ["DFlashDraftModel"]
    assert written["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert written["dflash_config"]["mask_token_id"] == 47 and written["block_size"] == 6
    assert "eagle_aux_hidden_state_layer_ids" not in written  # vLLM would read it first
    assert DFlashConfig.from_config_json(written) == cfg
    own = DFlashConfig.from_target(tiny_target_config(mask_token_id=7))
    assert own.mask_token_id == 7


@pytest.mark.parametrize("change, error", [
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, "overrides dflash_config"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 48}},
     r"mask_token_id 48 is not a row of the target's vocab \[0, 48\)"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 7], "mask_token_id": 4}},
     r"must be in \[0, 6\]"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 4, "causal": True}},
     "non-causal"),
    ({"block_size": 9}, "block_size 9 and dflash_config.block_size 6 differ"),
    ({"is_causal": True}, "non-causal blocks"),
    ({"is_neox_style": False}, "halves layout"),
])
def test_a_config_the_engines_would_read_otherwise_is_refused_by_name(change, error):
    written = DFlashConfig.from_target(tiny_target_config(), layers=3,
                                       block_size=6).to_config_json()
    with pytest.raises(ValueError, match=error):
        DFlashConfig.from_config_json({**written, **change})


def test_a_target_the_engines_cannot_capture_for_is_refused_up_front():
    gemma = {**tiny_target_config().to_dict(), "model_type": "gemma2"}
    with pytest.raises(ValueError, match="DFlash cannot be served for a 'gemma2' target"):
        DFlashConfig.from_target(gemma)
    with pytest.raises(ValueError, match="as wide as its target"):
        from pipeline.eagle3.config import DrafterShape
        DFlashConfig.from_target(tiny_target_config(), shape=DrafterShape(hidden_size=16))


def _batch(model, seed: int = 0) -> BlockBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, T), generator=g)
    aux = torch.randn(2, T, model.config.fc_in_features, generator=g)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[:, :4] = False  # a prompt
    real = torch.ones(2, T, dtype=torch.bool)
    real[1, 15:] = False  # right padding
    final = torch.randn(2, T, model.config.hidden_size, generator=g)
    return BlockBatch(ids, aux, mask, real, final)


def test_training_computes_each_block_as_the_equations_do():
    """Several anchors per row (and a row padded with an empty block), each block seeing
    only context before its anchor and its own block: the logits of every scored slot equal
    the block written out position by position."""
    model = tiny_dflash()
    batch = _batch(model)
    anchors = [[4, 9, 13, 18], [6, 12]]  # 18: its last slots run past the end
    blocks = lay_out(batch, 4, 99, model.config.mask_token_id, 4.0, anchors)
    positions = torch.arange(T).expand(2, T)
    hidden = model.blocks(blocks.tokens, blocks.positions,
                          model.context_kv(model.context(batch.aux_hidden), positions),
                          blocks.allowed)
    logits = model.compute_logits(hidden)
    mask = model.config.mask_token_id
    for row, chosen in enumerate(anchors):
        for n, a in enumerate(chosen):
            want = block_logits(model, batch.aux_hidden[row, :a],
                                [int(batch.input_ids[row, a])] + [mask] * 3, a)
            got = logits[row, n * 4 + 1:(n + 1) * 4]
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    length = [T, 15]
    for row, chosen in enumerate(anchors):  # weights: decayed, zero past the end
        for n, a in enumerate(chosen):
            for j in range(1, 4):
                w = float(blocks.weight[row, n * 4 + j])
                inside = a + j < length[row]
                assert w == pytest.approx(torch.exp(torch.tensor(-(j - 1) / 4.0)).item()
                                          if inside else 0.0)
                if inside:
                    assert int(blocks.labels[row, n * 4 + j]) == int(batch.input_ids[row, a + j])
    assert float(blocks.weight[1, 8:].sum()) == 0.0  # the padding blocks score nothing


def test_drafting_proposes_the_block_the_equations_give():
    """After the prompt and after a cycle, the proposer's block (its root at the next
    position, every verified position's features as context) is the written-out block."""
    model = tiny_dflash(1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (T,), generator=g)
    aux = torch.randn(T, model.config.fc_in_features, generator=g)
    proposer = as_drafter(model)
    assert isinstance(proposer, DFlashProposer) and proposer.aux_layer_ids == (1, 5)
    proposer.reset(ids[:7].tolist())
    proposer.extend(ids[1:8], aux[:7])  # prompt x0..x6; x7 the root
    for committed, extra in ((7, 0), (7, 3)):
        if extra:
            proposer.extend(ids[8:8 + extra], aux[7:7 + extra])  # a cycle verified 3
        c = committed + extra
        tree = CandidateTree()
        probs, top = proposer.propose(tree, [ROOT], 2)
        want = torch.softmax(block_logits(model, aux[:c], [int(ids[c])] + [47] * 3, c), -1)
        torch.testing.assert_close(probs[0].double(), want[0].topk(2).values, rtol=1e-4,
                                   atol=1e-5)
        assert top[0].tolist() == want[0].topk(2).indices.tolist()
        node = tree.add([int(top[0, 0])], [ROOT], 1, probs[0, :1])
        probs2, top2 = proposer.propose(tree, node, 1)
        assert top2[0].tolist() == want[1].topk(1).indices.tolist()
    with pytest.raises(ValueError, match="drafts a chain"):
        proposer.propose(tree, [*node, *node], 1)


def test_the_loss_is_the_weighted_cross_entropy_of_valid_anchors_and_learns():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
    real = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    assert valid_anchors(mask, real).nonzero().flatten().tolist() == [1, 2, 5]
    model = tiny_dflash(3)
    model.train()
    batch = _batch(model, 4)
    for n in (3, 99):  # drawn: min(n, #valid) distinct valid anchors per row
        torch.manual_seed(1)
        blocks = lay_out(batch, 4, n, model.config.mask_token_id, 4.0)
        for row in range(2):
            valid = set(valid_anchors(batch.loss_mask[row], batch.real[row]).nonzero()
                        .flatten().tolist())
            starts = blocks.positions[row, blocks.slot[row] == 0].tolist()
            anchors = [p for p in starts if p > 0]  # padding blocks sit at 0 (never valid)
            assert len(set(anchors)) == min(n, len(valid)) and set(anchors) <= valid
    # by hand, for fixed anchors: Σ CE·w / Σ w over the scored slots, CE against the token
    # or (KD) against the target's distribution at the position before it
    anchors = [[5, 16], [9]]
    for kd in (False, True):
        loss, _ = block_loss(model, batch, 0, gamma=2.0, anchors=anchors, kd=kd)
        num = den = 0.0
        for row, chosen in enumerate(anchors):
            for a in chosen:
                logits = block_logits(model, batch.aux_hidden[row, :a].detach(),
                                      [int(batch.input_ids[row, a])] + [47] * 3, a)
                for j in range(1, 4):
                    p = a + j
                    if p < int(batch.real[row].sum()) and batch.loss_mask[row, p]:
                        w = math.exp(-(j - 1) / 2.0)
                        log_q = torch.log_softmax(logits[j - 1], -1)
                        teacher = torch.softmax(
                            batch.final_hidden[row, p - 1].double() @ model.head.double().T, -1)
                        ce = -(teacher * log_q).sum() if kd else \
                            -log_q[int(batch.input_ids[row, p])]
                        num, den = num + w * float(ce), den + w
        assert float(loss.detach()) == pytest.approx(num / den, rel=1e-4)
    torch.manual_seed(0)
    first, metrics = block_loss(model, batch, 8)
    assert len(metrics.accuracy) == 3 and sum(metrics.count) > 0
    frozen = (model.embed_tokens.weight.clone(), model.head.clone())
    assert not any(p is model.head or p is model.embed_tokens.weight
                   for p in model.trainable_parameters())
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    for _ in range(30):
        torch.manual_seed(0)  # the same anchors: a fixed batch to fit
        loss, _ = block_loss(model, batch, 8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.5 * float(first.detach())
    assert torch.equal(model.embed_tokens.weight, frozen[0])  # the target's: never trained
    assert torch.equal(model.head, frozen[1])


def test_an_export_loads_in_the_engines_names_and_is_checked(tmp_path):
    model = tiny_dflash(5)
    out = save_drafter(model, tmp_path / "d", dtype=torch.float32)
    assert algorithm_of_directory(out).name == "dflash" and format_errors(out) == ()
    back = load_drafter(out, model.embed_tokens.weight, head=model.head)
    assert {k: v.shape for k, v in back.state_dict().items()} == \
        {k: v.shape for k, v in model.state_dict().items()}
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors and "embed_tokens.weight" not in tensors
    save_file({**tensors, "fc.weight": torch.zeros(32, 3 * 32),
               "midlayer.norm.weight": torch.ones(32)}, str(out / "model.safetensors"))
    assert format_errors(out) == ("midlayer.norm.weight is not a DFlash weight (SGLang would "
                                  "ignore it)", "fc.weight is [32, 96], expected [32, 64]")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids":
                                                 [2, 7]}))
    (error,) = format_errors(out)
    assert "overrides dflash_config.target_layer_ids in vLLM" in error


def test_a_warm_start_copies_every_weight_only_when_shapes_and_layers_fit(tmp_path):
    source = save_drafter(tiny_dflash(6), tmp_path / "src", dtype=torch.float32)
    model = tiny_dflash(7)
    assert warm_start_from(model, source, "src")["mode"] == "warm"
    assert torch.equal(model.fc.weight, load_drafter(source, model.embed_tokens.weight,
                                                     head=model.head).fc.weight)
    deeper = tiny_dflash(7, layers=3)
    record = warm_start_from(deeper, source, "src")
    assert record["mode"] == "scratch" and "num_hidden_layers': (2, 3)" in record["reason"]
    other_mask = tiny_dflash(7, target=tiny_target_config(mask_token_id=3))
    assert warm_start_from(other_mask, source, "src")["reason"] == \
        "mask_token_id differs (old, new): (47, 3)"


def test_dflash_serves_with_each_engines_count_of_its_block():
    block = SpecParams(7, 1, 8)
    assert serving_args(block, "/d", algorithm="dflash") == (
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d",
        "--speculative-num-draft-tokens", "8")
    assert vllm_speculative_config(block, "/d", algorithm="dflash") == \
        '{"method":"dflash","model":"/d","num_speculative_tokens":7}'
    with pytest.raises(ValueError, match="DFlash drafts a chain"):
        serving_args(SpecParams(3, 2, 6), "/d", algorithm="dflash")
    assert algorithm("dflash").title == "DFlash"


def test_a_window_captured_for_several_algorithms_trains_each_on_its_own_layers():
    target = {"num_hidden_layers": 8, "model_type": "llama"}
    union = (1, 2, 3, 4, 5)  # EAGLE-3's 1, 3, 4 and DFlash's 1..5 for an 8-layer target
    assert trained_layers("eagle3", union, target) == (1, 3, 4)
    assert trained_layers("dflash", union, target) == union
    assert trained_layers("eagle3", (0, 2, 5), target) == (0, 2, 5)  # the capture's choice
    assert layer_columns(union, (1, 3, 4), 2).tolist() == [0, 1, 4, 5, 6, 7]
    assert layer_columns(union, union, 2) is None
