"""Format validation finds every way a drafter directory would load wrong in SGLang."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.eagle3.format_check import drafter_format_errors
from tests.release.helpers import make_drafter_dir


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("fmt") / "good")


def edited(tmp_path, good, edit):
    d = tmp_path / "edited"
    d.mkdir()
    (d / "config.json").write_text((good / "config.json").read_text())
    tensors = load_file(str(good / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_valid_drafter_has_no_errors(good):
    assert drafter_format_errors(good) == ()


@pytest.mark.parametrize("edit,expected", [
    (lambda t: t.pop("d2t"), "missing tensors ['d2t']"),
    (lambda t: t.update({"embed_tokens.weight": torch.zeros(2, 2)}), "unexpected tensors"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(5, 32)}), "lm_head.weight: shape"),
    (lambda t: t["fc.weight"].__setitem__((0, 0), float("nan")), "NaN"),
    (lambda t: t.update({"d2t": t["d2t"].to(torch.int32)}), "d2t: dtype"),
    (lambda t: t.update({"d2t": torch.zeros_like(t["d2t"])}), "vocab mapping"),
    (lambda t: t.update({"norm.weight": t["norm.weight"].to(torch.bfloat16)}), "mix dtypes"),
])
def test_each_defect_is_reported(tmp_path, good, edit, expected):
    errors = drafter_format_errors(edited(tmp_path, good, edit))
    assert any(expected in e for e in errors), errors


def test_missing_files_bad_config_and_corrupt_weights(tmp_path, good):
    assert drafter_format_errors(tmp_path) == ("config.json is missing",)
    d = tmp_path / "d"
    d.mkdir()
    cfg = json.loads((good / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    assert drafter_format_errors(d) == ("model.safetensors is missing",)
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    assert "not a valid EAGLE-3 drafter config" in drafter_format_errors(d)[0]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "cannot be read" in drafter_format_errors(d)[-1]
