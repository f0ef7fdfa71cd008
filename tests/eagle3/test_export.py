"""SGLang checkpoint: exact names, shapes and dtypes; config.json; atomicity; round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pipeline.drafters import files
from pipeline.eagle3.config import DrafterShape
from pipeline.eagle3.export import load_drafter, save_drafter, warm_start
from pipeline.eagle3.model import EXPORTED_NAMES, Eagle3Drafter, project_embedding
from pipeline.vocab.mapping import build_vocab_mapping
from tests.eagle3.helpers import tiny_drafter

WEIGHT_NAMES = set(EXPORTED_NAMES) - {"d2t", "t2d"}


def read_checkpoint(directory):
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_saved_names_shapes_and_dtypes(tmp_path):
    model = tiny_drafter(31)
    out = save_drafter(model, model.config, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = read_checkpoint(out)
    assert set(tensors) == set(EXPORTED_NAMES)
    assert not any("embed" in name for name in tensors)
    for name, x in tensors.items():
        ref = model.state_dict()[name]
        assert x.shape == ref.shape, name
        if name in WEIGHT_NAMES:
            assert x.dtype == torch.bfloat16, name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"], model.d2t) and torch.equal(tensors["t2d"], model.t2d)
    config = json.loads((out / "config.json").read_text())
    assert config == model.config.to_sglang_config("bfloat16")
    assert config["rope_theta"] == model.config.rope_theta
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_round_trip_gives_identical_logits(tmp_path, dtype):
    model = tiny_drafter(32)
    out = save_drafter(model, model.config, tmp_path / "d", dtype=dtype)
    embedding = nn.Embedding.from_pretrained(model.embed_tokens.weight.clone())
    loaded = load_drafter(out, embedding)
    assert loaded.config == model.config and loaded.dtype == dtype
    expected = model.to(dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    aux = torch.randn(2, 9, model.config.fc_in_features, generator=g)
    with torch.no_grad():
        assert torch.equal(loaded(ids, aux)[1], expected(ids, aux)[1])
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)


NARROW = DrafterShape(hidden_size=16, head_dim=8)  # a 16-wide drafter of a 32-wide target


def test_a_drafter_of_another_width_exports_its_own_embedding(tmp_path):
    """SGLang and vLLM keep the draft's own ``embed_tokens`` when ``target_hidden_size``
    differs from ``hidden_size``: it is exported, and the round trip is exact."""
    model = tiny_drafter(33, shape=NARROW)
    cfg = model.config
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.fc_in_features) == (16, 32, 96)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 2, 8)
    out = save_drafter(model, cfg, tmp_path / "narrow", dtype=torch.float32)
    written = json.loads((out / "config.json").read_text())
    assert written["hidden_size"] == 16 and written["target_hidden_size"] == 32
    tensors = read_checkpoint(out)
    assert set(tensors) == set(EXPORTED_NAMES) | {"embed_tokens.weight"}
    assert tensors["embed_tokens.weight"].shape == (cfg.vocab_size, 16)
    assert tensors["fc.weight"].shape == (16, 96)
    # the embedding is a fixed function of the target's: the same table from the same target
    target_embed = torch.randn(cfg.vocab_size, 32, generator=torch.Generator().manual_seed(4))
    again = Eagle3Drafter(cfg, target_embed)
    assert torch.equal(again.embed_tokens.weight, project_embedding(target_embed, 16))
    assert not again.embed_tokens.weight.requires_grad
    assert "embed_tokens.weight" not in dict(again.named_parameters())
    # loading ignores the target embedding passed in and uses the exported one
    loaded = load_drafter(out, torch.zeros(cfg.vocab_size, 32))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    aux = torch.randn(2, 7, cfg.fc_in_features, generator=g)
    with torch.no_grad():
        assert torch.equal(loaded(ids, aux)[1], model(ids, aux)[1])


def test_projection_keeps_token_geometry():
    """Orthonormal: a narrower table keeps pairwise angles approximately; a same-width
    one exactly (a rotation)."""
    weight = torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    rotated = project_embedding(weight, 32)
    torch.testing.assert_close(rotated @ rotated.T, weight @ weight.T, rtol=1e-4, atol=1e-4)
    wider = project_embedding(weight, 48)
    torch.testing.assert_close(wider @ wider.T, weight @ weight.T, rtol=1e-4, atol=1e-4)


def test_save_is_atomic_and_refuses_to_clobber(tmp_path, monkeypatch):
    model = tiny_drafter(33)
    target = tmp_path / "d"
    save_drafter(model, model.config, target)
    with pytest.raises(FileExistsError):
        save_drafter(model, model.config, target)
    before = (target / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", boom)  # every algorithm's export writes there
    with pytest.raises(OSError, match="disk full"):
        save_drafter(model, model.config, target, overwrite=True)
    assert (target / "model.safetensors").read_bytes() == before  # old checkpoint intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp dirs left
    monkeypatch.undo()

    other = tiny_drafter(34)
    save_drafter(other, other.config, target, overwrite=True)
    assert (target / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_load_refuses_unknown_or_missing_tensors(tmp_path):
    model = tiny_drafter(35)
    out = save_drafter(model, model.config, tmp_path / "d")
    tensors = read_checkpoint(out)
    save_file({**tensors, "embed_tokens.weight": model.embed_tokens.weight}, str(
        out / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected"):
        load_drafter(out, model.embed_tokens.weight)
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_drafter(out, model.embed_tokens.weight)


def test_save_requires_the_models_config(tmp_path):
    model = tiny_drafter(36)
    other = tiny_drafter(36, draft_vocab_size=12)
    with pytest.raises(ValueError, match="config"):
        save_drafter(model, other.config, tmp_path / "d")


def test_warm_start_keeps_lm_head_rows_with_their_target_tokens():
    old = tiny_drafter(37)
    cfg = old.config
    new = Eagle3Drafter(cfg, old.embed_tokens.weight)
    counts = torch.arange(cfg.vocab_size).flip(0)  # a different vocab: the lowest ids
    mapping = build_vocab_mapping(counts, cfg.draft_vocab_size)
    new.set_vocab(mapping.d2t, mapping.t2d)
    fresh = new.lm_head.weight.detach().clone()
    carried = warm_start(new, old)
    old_ids = old.to_target_ids(torch.arange(cfg.draft_vocab_size)).tolist()
    new_ids = new.to_target_ids(torch.arange(cfg.draft_vocab_size)).tolist()
    assert carried == len(set(old_ids) & set(new_ids)) > 0
    for row, token in enumerate(new_ids):
        expected = (old.lm_head.weight[old_ids.index(token)] if token in old_ids
                    else fresh[row])
        assert torch.equal(new.lm_head.weight[row], expected)
    assert torch.equal(new.fc.weight, old.fc.weight)
    assert torch.equal(new.midlayer.mlp.up_proj.weight, old.midlayer.mlp.up_proj.weight)
    with pytest.raises(ValueError, match="shapes"):
        warm_start(tiny_drafter(38, draft_vocab_size=12), old)
