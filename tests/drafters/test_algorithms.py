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
    algorithm_of_config,
    algorithm_of_directory,
    as_drafter,
    format_errors,
    served_name_known,
)
from pipeline.drafters.protocol import Drafter
from pipeline.eagle3.algorithm import EAGLE3, EAGLE31
from pipeline.eagle3.export import load_drafter
from pipeline.eagle3.proposer import Eagle3Proposer
from pipeline.eagle3.spec import SpecParams
from pipeline.serving_now import engine_args, serving_args, vllm_speculative_config
from pipeline.training.config import TrainConfig
from pipeline.training.warmstart import apply_warm_start
from resources.env import EnvConfigError
from resources.run_config import drafter_algorithm_from_env
from tests.release.helpers import TARGET_VOCAB, make_drafter_dir

CHAIN = SpecParams(3, 1, 4)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("alg") / "eagle3")


def test_every_algorithm_is_registered_once_and_claims_its_own_exports():
    assert DEFAULT_ALGORITHM == "eagle3"
    assert list(ALGORITHMS) == ["eagle3", "eagle3.1", "dflash"]
    for name, a in ALGORITHMS.items():
        assert a.name == name
        target = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 8,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 48,
                  "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
                  "model_type": "llama"}
        exported = a.config_json(a.new_config(target, draft_vocab_size=24))
        assert algorithm_of_config(exported, "x") is a


def test_lookups_refuse_what_no_algorithm_claims_naming_it(tmp_path):
    assert algorithm("eagle3") is EAGLE3
    with pytest.raises(UnknownAlgorithmError,
                       match=r"'medusa' is not one of \['dflash', 'eagle3', 'eagle3.1'\]"):
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


def test_what_an_engine_reports_serving_is_checked_against_the_engines_names():
    assert served_name_known("eagle3")  # SGLang upper-cases
    assert served_name_known("DFLASH")
    assert not served_name_known("NEXTN")
    assert not served_name_known(None)


class OtherDraft(nn.Module):
    pass


def test_warm_start_never_crosses_algorithms(tmp_path, exported, monkeypatch):
    other = replace(EAGLE3, name="other", title="Other", architectures=("OtherDraft",),
                    claims=lambda config: True, sglang_algorithm="OTHER",
                    vllm_method="other", build=OtherDraft,
                    is_model=lambda obj: isinstance(obj, OtherDraft))
    monkeypatch.setitem(algorithms.ALGORITHMS, "other", other)
    cfg = json.loads((exported / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["OtherDraft"]}))
    model = load_drafter(exported, torch.zeros(TARGET_VOCAB, 32))
    decided = apply_warm_start(model, tmp_path, source="v7")
    assert decided == {"mode": "scratch", "source": "v7", "lm_head_rows_carried": 0,
                       "reason": "algorithms differ (old, new): (Other, EAGLE-3)"}
    assert apply_warm_start(model, exported)["mode"] == "warm"
    v31 = load_drafter(make_drafter_dir(tmp_path / "v31", v31=True), torch.zeros(TARGET_VOCAB, 32))
    assert apply_warm_start(v31, exported)["reason"] == \
        "algorithms differ (old, new): (EAGLE-3, EAGLE 3.1)"


def test_the_trained_algorithm_is_a_run_config_choice_fingerprinted_unless_default():
    # the fingerprints runs had before the choice existed (pinned from 2530c3c)
    assert TrainConfig().fingerprint() == \
        "baa46a90dddc6b4ef7bd7f3d6a8183393a3a23bbf91e4f0fd90d65f64d490244"
    assert TrainConfig(lr=1e-3, epochs=3, micro_batch_size=8,
                       drafter_hidden_size=32).fingerprint() == \
        "813b7a2ee75998635076abe70cd2478eac4034fcf222eb3922f7fd117d2bdd76"
    assert TrainConfig(drafter_algorithm="eagle3").fingerprint() == TrainConfig().fingerprint()
    assert TrainConfig(drafter_algorithm="eagle3.1").fingerprint() != \
        TrainConfig().fingerprint()
    with pytest.raises(UnknownAlgorithmError, match="'medusa' is not one of"):
        TrainConfig(drafter_algorithm="medusa")
    # an algorithm's own settings count only when it is the one trained
    assert TrainConfig(dflash_block_size=16).fingerprint() == TrainConfig().fingerprint()
    dflash = TrainConfig(drafter_algorithm="dflash")
    assert replace(dflash, dflash_block_size=16).fingerprint() != dflash.fingerprint()
    assert EAGLE31.new_config(
        {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 8,
         "num_attention_heads": 4, "vocab_size": 48, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "rope_theta": 1e4}).to_sglang_config()["norm_output"] is True


def test_the_deployment_names_the_algorithm_in_the_refresh_jobs_run_config(monkeypatch):
    monkeypatch.setenv("AERIE_DRAFTER_ALGORITHM", "eagle3.1")
    assert drafter_algorithm_from_env() == {
        "ops": {"drafter_checkpoint": {"config": {"drafter_algorithm": "eagle3.1"}}}}
    monkeypatch.setenv("AERIE_DRAFTER_ALGORITHM", "eagle4")
    with pytest.raises(EnvConfigError, match="AERIE_DRAFTER_ALGORITHM: drafter algorithm "
                                             "'eagle4' is not one of"):
        drafter_algorithm_from_env()
    monkeypatch.delenv("AERIE_DRAFTER_ALGORITHM")
    assert drafter_algorithm_from_env() == {}
