"""Aux layer ids: what every engine can capture, the same layers named for SGLang and vLLM."""

from __future__ import annotations

import pytest

from pipeline.eagle3.aux_layers import (
    AUX_CAPTURE,
    check_aux_layer_ids,
    default_aux_layer_ids,
    engine_default_ids,
    ids_from_config,
)
from pipeline.eagle3.config import DrafterConfig
from tests.capture.helpers import tiny_llama


@pytest.mark.parametrize("layers", range(4, 129))
def test_defaults_are_capturable_by_every_engine(layers):
    ids = default_aux_layer_ids(layers)
    assert check_aux_layer_ids(ids, layers) == ids  # distinct, ascending, <= N - 2
    assert len(ids) == 3
    if layers >= 7:  # deep enough: exactly the layers the engines capture when not told
        assert ids == engine_default_ids(layers)


def test_shallow_defaults_no_longer_repeat_a_layer():
    # before: [1, 1, 0] for the 4-layer demo target and [1, 2, 2] for 6 layers
    assert default_aux_layer_ids(4) == (0, 1, 2)
    assert default_aux_layer_ids(5) == (1, 2, 3)
    assert default_aux_layer_ids(6) == (1, 2, 4)
    assert default_aux_layer_ids(32) == (1, 15, 28)  # Llama-3-8B: SpecForge's [1, 15, 28]
    with pytest.raises(ValueError, match="3-layer target has no three distinct"):
        default_aux_layer_ids(3)
    # DeepSeek-style targets: SGLang shifts their ids only when the first is 1
    assert default_aux_layer_ids(5, "deepseek_v3") == (1, 2, 3)
    with pytest.raises(ValueError, match="4-layer deepseek_v3 target has no three"):
        default_aux_layer_ids(4, "deepseek_v3")


@pytest.mark.parametrize(("ids", "layers", "message"), [
    ([1, 1, 0], 4, "distinct and ascending"),
    ([2, 1, 3], 8, "distinct and ascending"),
    ([1, 3, 7], 8, "in \\[0, 6\\]; id 7 .*not captured by SGLang"),
    ([-1, 2, 3], 8, "start at 0"),
    ([1, True, 3], 8, "must be an integer"),
    ([1.0, 2, 3], 8, "must be an integer"),
    ([], 8, "non-empty list"),
    ("123", 8, "non-empty list"),
])
def test_bad_ids_are_refused_naming_what_is_wrong(ids, layers, message):
    with pytest.raises(ValueError, match=message):
        check_aux_layer_ids(ids, layers, where="capture.aux_layer_ids")


def test_deepseek_targets_start_at_layer_one():
    assert check_aux_layer_ids([1, 29, 57], 61, model_type="deepseek_v3") == (1, 29, 57)
    with pytest.raises(ValueError, match="deepseek_v3 target needs the first id to be 1"):
        check_aux_layer_ids([0, 29, 57], 61, model_type="deepseek_v3")


def test_the_export_names_the_same_layers_for_sglang_and_vllm():
    config = DrafterConfig.from_target(tiny_llama(layers=8, hidden=64).config,
                                       draft_vocab_size=64)
    cfg = config.to_sglang_config()
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: output of k - 1
    assert cfg["num_aux_hidden_states"] == 3
    assert cfg["eagle_config"]["aux_hidden_state_capture"] == AUX_CAPTURE
    assert DrafterConfig.from_sglang_config(cfg) == config


@pytest.mark.parametrize(("change", "message"), [
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "vLLM's numbering.*expected \\[2, 4, 5\\]"),
    ({"num_aux_hidden_states": 2}, "num_aux_hidden_states 2 but 3"),
])
def test_a_config_whose_lists_disagree_is_refused(change, message):
    cfg = DrafterConfig.from_target(tiny_llama(layers=8, hidden=64).config,
                                    draft_vocab_size=64).to_sglang_config()
    with pytest.raises(ValueError, match=message):
        ids_from_config({**cfg, **change})


def test_a_config_of_another_capture_convention_is_refused():
    cfg = DrafterConfig.from_target(tiny_llama(layers=8, hidden=64).config,
                                    draft_vocab_size=64).to_sglang_config()
    cfg["eagle_config"]["aux_hidden_state_capture"] = "layer_input"
    with pytest.raises(ValueError, match="captured as 'layer_input'"):
        DrafterConfig.from_sglang_config(cfg)


def test_older_exports_without_the_new_keys_still_load():
    cfg = DrafterConfig.from_target(tiny_llama(layers=8, hidden=64).config,
                                    draft_vocab_size=64).to_sglang_config()
    for key in ("eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states"):
        del cfg[key]
    del cfg["eagle_config"]["aux_hidden_state_capture"]
    assert DrafterConfig.from_sglang_config(cfg).aux_layer_ids == (1, 3, 4)
