"""SpecParams: SGLang's rules for (num_steps, eagle_topk, num_draft_tokens)."""

from __future__ import annotations

import logging

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.records import from_dict, to_dict


@pytest.mark.parametrize("args", [(5, 1, 6), (3, 1, 4), (1, 1, 2), (5, 4, 8), (2, 4, 21),
                                  (1, 4, 5), (6, 3, 10)])
def test_valid(args):
    params = SpecParams(*args)
    assert (params.num_steps, params.eagle_topk, params.num_draft_tokens) == args
    assert from_dict(SpecParams, to_dict(params)) == params


@pytest.mark.parametrize("args, field, fragment", [
    ((0, 1, 1), "num_steps", ">= 1"),
    ((5, 0, 6), "eagle_topk", ">= 1"),
    ((5, 4, 0), "num_draft_tokens", ">= 1"),
    ((5, 4, 1), "num_draft_tokens", ">= 2"),
    ((True, 1, 2), "num_steps", "integer"),
    ((5, 2.0, 8), "eagle_topk", "integer"),
    ((5, 1, 8), "num_draft_tokens", "num_steps + 1"),  # a chain verifies steps + 1 nodes
    ((5, 1, 4), "num_draft_tokens", "num_steps + 1"),
    ((1, 4, 6), "num_draft_tokens", "4 candidates"),  # depth 1 has only topk candidates
    ((2, 4, 22), "num_draft_tokens", "20 candidates"),  # 4 + 16
])
def test_invalid_names_the_field(args, field, fragment):
    with pytest.raises(ValueError) as err:
        SpecParams(*args)
    assert field in str(err.value) and fragment in str(err.value)


def test_max_candidates_is_sglang_topk_pool():
    assert SpecParams(5, 4, 8).max_candidates == 4 + 4 * 16
    assert SpecParams(5, 1, 6).max_candidates == 5


@pytest.mark.parametrize("arch, expected", [
    ("LlamaForCausalLM", (5, 4, 8)), (["LlamaForCausalLM"], (5, 4, 8)),
    ("Grok1ForCausalLM", (5, 4, 8)), ("Qwen2ForCausalLM", (3, 1, 4)),
    ("DeepseekV3ForCausalLM", (3, 1, 4)), (None, (3, 1, 4)), ([], (3, 1, 4)),
])
def test_auto_defaults(arch, expected):
    assert SpecParams.auto_for(arch) == SpecParams(*expected)
    assert SpecParams.resolve(architecture=arch) == SpecParams(*expected)


@pytest.mark.parametrize("kwargs, missing", [
    ({"num_steps": 5}, "eagle_topk, num_draft_tokens"),
    ({"num_steps": 5, "eagle_topk": 4}, "num_draft_tokens"),
    ({"num_draft_tokens": 8}, "num_steps, eagle_topk"),
])
def test_resolve_all_or_none(kwargs, missing):
    with pytest.raises(ValueError, match=f"missing {missing}$"):
        SpecParams.resolve(**kwargs)


def test_resolve_adjusts_a_chain_like_the_server(caplog):
    with caplog.at_level(logging.WARNING):
        params = SpecParams.resolve(5, 1, 8)
    assert params == SpecParams(5, 1, 6)
    assert "adjusted" in caplog.text
    assert SpecParams.resolve(5, 4, 8) == SpecParams(5, 4, 8)


def test_sglang_args():
    assert SpecParams(5, 4, 8).sglang_args() == [
        "--speculative-num-steps", "5", "--speculative-eagle-topk", "4",
        "--speculative-num-draft-tokens", "8"]


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        from_dict(SpecParams, {"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6, "x": 1})
