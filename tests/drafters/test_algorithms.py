"""The drafter-algorithm seam: one registration per algorithm, lookups that refuse by name,
and EAGLE-3 behind it with the flags, checks and proposer it had before."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from pipeline import algorithms
from pipeline.algorithms import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    UnknownAlgorithmError,
    algorithm,
    algorithm_of_directory,
    algorithm_of_model,
    algorithm_served_as,
    as_drafter,
    format_errors,
)
from pipeline.drafters.protocol import Drafter
from pipeline.eagle3.algorithm import EAGLE3
from pipeline.eagle3.export import load_drafter
from pipeline.eagle3.proposer import Eagle3Proposer
from pipeline.eagle3.spec import SpecParams
from pipeline.serving_now import engine_args, serving_args, vllm_speculative_config
from pipeline.training.warmstart import apply_warm_start
from tests.release.helpers import TARGET_VOCAB, make_drafter_dir

CHAIN = SpecParams(3, 1, 4)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("alg") / "eagle3")


def test_every_algorithm_is_registered_once_under_names_no_other_claims():
    assert DEFAULT_ALGORITHM in ALGORITHMS
    for name, a in ALGORITHMS.items():
        assert a.name == name
    for field in ("architectures", "sglang_algorithm", "vllm_method", "model"):
        claimed = [v for a in ALGORITHMS.values()
                   for v in (getattr(a, field) if field == "architectures"
                             else (getattr(a, field),))]
        assert len(claimed) == len(set(claimed)), field


def test_lookups_refuse_what_no_algorithm_claims_naming_it(tmp_path):
    assert algorithm("eagle3") is EAGLE3
    with pytest.raises(UnknownAlgorithmError, match=r"'medusa' is not one of \['eagle3'\]"):
        algorithm("medusa")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnknownAlgorithmError, match=r"config\.json: architectures "
                                                      r"\['LlamaForCausalLM'\] name no"):
        algorithm_of_directory(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UnknownAlgorithmError, match="is not a JSON object"):
        algorithm_of_directory(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnknownAlgorithmError, match="cannot be read as JSON"):
        algorithm_of_directory(tmp_path)
    with pytest.raises(UnknownAlgorithmError, match="Linear is the model of no drafter"):
        algorithm_of_model(nn.Linear(2, 2))


def test_an_export_names_its_algorithm_and_is_checked_by_that_algorithm(tmp_path, exported):
    assert algorithm_of_directory(exported) is EAGLE3
    assert format_errors(exported) == ()
    assert format_errors(tmp_path) == ("config.json is missing",)
    cfg = json.loads((exported / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["X"]}))
    (errors,) = format_errors(tmp_path)
    assert "architectures ['X'] name no drafter algorithm" in errors
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # EAGLE-3's own check runs
    assert format_errors(tmp_path) == ("model.safetensors is missing",)


def test_the_engine_drives_an_algorithms_model_through_its_proposer(exported):
    model = load_drafter(exported, torch.zeros(TARGET_VOCAB, 32))
    assert algorithm_of_model(model) is EAGLE3
    proposer = as_drafter(model)
    assert isinstance(proposer, Eagle3Proposer) and isinstance(proposer, Drafter)
    assert as_drafter(proposer) is proposer  # a Drafter passes as is
    with pytest.raises(TypeError, match="neither a drafter algorithm's model"):
        as_drafter(nn.Linear(2, 2))


def test_eagle3_serves_with_the_flags_it_always_had():
    assert serving_args(CHAIN, "/d") == (
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4")
    assert vllm_speculative_config(CHAIN, "/d") == \
        '{"method":"eagle3","model":"/d","num_speculative_tokens":3}'
    assert engine_args("verl", CHAIN, "/d") == (
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method=eagle3",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.model=/d",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"
        ".num_speculative_tokens=3")
    with pytest.raises(ValueError, match="eagle_topk 4: vLLM drafts EAGLE-3 as a chain"):
        vllm_speculative_config(SpecParams(5, 4, 8), "/d")
    with pytest.raises(UnknownAlgorithmError):
        serving_args(CHAIN, "/d", algorithm="dflash-typo")
    with pytest.raises(ValueError, match="engine 'tgi' is not one of"):
        engine_args("tgi", CHAIN, "/d")


def test_what_an_engine_reports_serving_names_the_algorithm():
    assert algorithm_served_as(sglang_algorithm="eagle3") is EAGLE3  # SGLang upper-cases
    assert algorithm_served_as(vllm_method="eagle3") is EAGLE3
    assert algorithm_served_as(sglang_algorithm="NEXTN") is None
    assert algorithm_served_as(vllm_method="EAGLE3") is None  # vLLM's names are exact
    assert algorithm_served_as() is None


class OtherDraft(nn.Module):
    pass


def test_warm_start_never_crosses_algorithms(tmp_path, exported, monkeypatch):
    other = replace(EAGLE3, name="other", title="Other", architectures=("OtherDraft",),
                    sglang_algorithm="OTHER", vllm_method="other", model=OtherDraft)
    monkeypatch.setitem(algorithms.ALGORITHMS, "other", other)
    cfg = json.loads((exported / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["OtherDraft"]}))
    model = load_drafter(exported, torch.zeros(TARGET_VOCAB, 32))
    decided = apply_warm_start(model, tmp_path, source="v7")
    assert decided == {"mode": "scratch", "source": "v7", "lm_head_rows_carried": 0,
                       "reason": "algorithms differ (old, new): (Other, EAGLE-3)"}
    assert apply_warm_start(model, exported)["mode"] == "warm"
