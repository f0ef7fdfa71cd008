"""EAGLE 3.1 (EAGLE-3 + ``fc_norm`` + ``norm_output``): the config keys both engines read, the
tensors they load, and training == drafting == a hand-written reference of the two norms."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.algorithms import algorithm_of_directory, format_errors
from pipeline.drafters.protocol import ROOT, CandidateTree
from pipeline.eagle3.algorithm import EAGLE3, EAGLE31
from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.drafting import KVCache, decode, draft_reference_logits
from pipeline.eagle3.export import load_drafter, read_drafter_config, save_drafter
from pipeline.eagle3.model import exported_names
from pipeline.eagle3.proposer import Eagle3Proposer
from pipeline.eagle3.spec import SpecParams
from pipeline.eagle3.ttt import ttt_logits
from pipeline.serving_now import serving_args
from tests.eagle3.helpers import random_batch, tiny_drafter, tiny_target_config


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_the_31_keys_are_written_read_and_only_for_31():
    plain = DrafterConfig.from_target(tiny_target_config(), draft_vocab_size=24)
    v31 = replace(plain, fc_norm=True, norm_output=True)
    assert "fc_norm" not in plain.to_sglang_config()  # EAGLE-3's config.json is unchanged
    assert "norm_output" not in plain.to_sglang_config()
    cfg = v31.to_sglang_config()
    assert (cfg["fc_norm"], cfg["norm_output"]) == (True, True)
    assert DrafterConfig.from_sglang_config(cfg) == v31
    assert DrafterConfig.from_sglang_config({**plain.to_sglang_config(),
                                             "use_aux_norm": True}).fc_norm  # SGLang's alias
    assert exported_names(v31)[-3:] == ("fc_norm.0.weight", "fc_norm.1.weight",
                                        "fc_norm.2.weight")


@pytest.mark.parametrize("key", ["norm_before_fc", "norm_before_residual"])
def test_other_variants_called_31_are_refused_by_name(key):
    cfg = DrafterConfig.from_target(tiny_target_config(), draft_vocab_size=24).to_sglang_config()
    with pytest.raises(ValueError, match=f"config.json sets {key}"):
        DrafterConfig.from_sglang_config({**cfg, key: True})
    with pytest.raises(ValueError, match=f"config.json sets {key}"):
        DrafterConfig.from_sglang_config({**cfg, "eagle_config": {**cfg["eagle_config"],
                                                                  key: True}})
    with pytest.raises(ValueError, match="fc_norm must be true or false, got 'yes'"):
        DrafterConfig.from_sglang_config({**cfg, "fc_norm": "yes"})


def test_both_norms_change_what_the_drafter_computes():
    v31 = tiny_drafter(3, v31=True)
    plain = tiny_drafter(3)
    plain.load_state_dict({k: v for k, v in v31.state_dict().items()
                           if not k.startswith("fc_norm.")})
    batch = random_batch(v31, [9], seed=4)
    with torch.no_grad():
        a = ttt_logits(v31, batch.input_ids, batch.aux_hidden, 2)
        b = ttt_logits(plain, batch.input_ids, batch.aux_hidden, 2)
    assert (a[0] - b[0]).abs().max() > 0.1  # fc_norm
    no_feedback_norm = replace(v31.config, norm_output=False)
    v31.config = no_feedback_norm
    with torch.no_grad():
        c = ttt_logits(v31, batch.input_ids, batch.aux_hidden, 2)
    torch.testing.assert_close(c[0], a[0])  # step 0 does not read the feedback
    assert (c[1] - a[1]).abs().max() > 0.1  # norm_output


def test_training_and_drafting_equal_a_hand_written_31_reference():
    """Step 0 reads fc(RMS_i(aux_i) ...) and step 1 reads RMS_norm(step 0's output), written
    here from the equations (not through the model's project/feedback)."""
    model = tiny_drafter(5, v31=True)
    n, ht, eps = 10, model.config.target_hidden_size, model.config.rms_norm_eps
    batch = random_batch(model, [n], seed=6)
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    with torch.no_grad():
        parallel = ttt_logits(model, batch.input_ids, batch.aux_hidden, 3)
        drafted = draft_reference_logits(model, ids, aux, 3)
        normed = torch.cat([rms(aux[:, i * ht:(i + 1) * ht], model.fc_norm[i].weight, eps)
                            for i in range(3)], dim=-1)
        g = normed @ model.fc.weight.T
        cache, out = KVCache(), []
        for s in range(n):
            out.append(decode(model, cache, int(ids[s + 1]) if s + 1 < n else 0, g[s]))
        for t in range(n):
            h0 = out[t]
            chain = cache.prefix(t + 1)
            h1 = decode(model, chain, int(ids[t + 2]) if t + 2 < n else 0,
                        rms(h0, model.norm.weight, eps))
            want = model.lm_head(rms(h1, model.norm.weight, eps))
            torch.testing.assert_close(parallel[1][0, t], want, rtol=1e-5, atol=1e-5)
    for i in range(3):
        torch.testing.assert_close(parallel[i][0], drafted[i], rtol=1e-5, atol=1e-5)


def test_the_proposer_feeds_the_normed_output_back():
    """The engine's proposer, against decode() steps fed as the 3.1 equations say."""
    model = tiny_drafter(7, v31=True)
    n, eps = 8, model.config.rms_norm_eps
    batch = random_batch(model, [n], seed=8)
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    proposer = Eagle3Proposer(model)
    proposer.reset(ids[:1].tolist())
    tree = CandidateTree()
    with torch.no_grad():
        proposer.extend(ids[1:], aux[:-1])  # positions 0..n-2 with their next tokens
        p0, t0 = proposer.propose(tree, [ROOT], 1)
        node = tree.add([int(t0[0, 0])], [ROOT], 1, p0[0])
        p1, t1 = proposer.propose(tree, node, 1)
        cache, out, g = KVCache(), None, model.project(aux[None])[0]
        for s in range(n - 1):
            out = decode(model, cache, int(ids[s + 1]), g[s])
        first = torch.softmax(model.lm_head(rms(out, model.norm.weight, eps)), -1)
        h1 = decode(model, cache, int(t0[0, 0]), rms(out, model.norm.weight, eps))
        second = torch.softmax(model.lm_head(rms(h1, model.norm.weight, eps)), -1)
    torch.testing.assert_close(p0[0, 0], first.max(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p1[0, 0], second.max(), rtol=1e-5, atol=1e-6)
    assert int(model.to_target_ids(second.argmax())) == int(t1[0, 0])


def test_a_31_export_loads_is_checked_and_serves_with_eagle3s_flags(tmp_path):
    model = tiny_drafter(9, v31=True)
    d = save_drafter(model, model.config, tmp_path / "d", dtype=torch.float32)
    assert read_drafter_config(d) == model.config
    assert algorithm_of_directory(d) is EAGLE31 and format_errors(d) == ()
    loaded = load_drafter(d, model.embed_tokens.weight)
    torch.testing.assert_close(loaded.fc_norm[2].weight, model.fc_norm[2].weight)
    params = SpecParams(3, 1, 4)
    assert EAGLE31.sglang_args(params, "/d") == EAGLE3.sglang_args(params, "/d") == \
        serving_args(params, "/d")
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("fc_norm.1.weight")
    save_file(tensors, str(d / "model.safetensors"))
    assert any("missing tensors ['fc_norm.1.weight']" in e for e in format_errors(d))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "fc_norm": False, "norm_output": False}))
    assert algorithm_of_directory(d) is EAGLE3
    assert any("unexpected tensors" in e for e in format_errors(d))
