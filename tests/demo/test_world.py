"""End-to-end tests of the demo world on the small config: records, checkpoints, determinism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.demo import task
from pipeline.demo.config import DemoConfig
from pipeline.demo.corpus import encode_prompt
from pipeline.demo.world import RECORD_KEYS, StepOutput, WorldReport, generate_world

pytestmark = pytest.mark.integration

CONFIG = DemoConfig.small()


def _run(work_dir: Path) -> tuple[WorldReport, list[StepOutput]]:
    outputs: list[StepOutput] = []
    report = generate_world(CONFIG, work_dir, on_step=outputs.append, progress=False)
    return report, outputs


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[WorldReport, list[StepOutput]]:
    return _run(tmp_path_factory.mktemp("world-a"))


@pytest.fixture(scope="session")
def world_again(tmp_path_factory: pytest.TempPathFactory) -> tuple[WorldReport, list[StepOutput]]:
    return _run(tmp_path_factory.mktemp("world-b"))


def test_one_output_per_step_with_policy_checkpoint(world) -> None:
    report, outputs = world
    assert [o.step for o in outputs] == list(range(CONFIG.num_steps))
    assert [o.policy_version for o in outputs] == list(range(CONFIG.num_steps))
    for out in outputs:
        assert out.policy_dir.name == f"step-{out.step:06d}"
        assert (out.policy_dir / "model.safetensors").is_file()
        assert (out.policy_dir / "tokenizer.json").is_file()
        assert len(out.records) == CONFIG.prompts_per_step * CONFIG.samples_per_prompt
    assert [s["step"] for s in report.steps] == list(range(CONFIG.num_steps))
    assert {"tokenizer_s", "pretrain_s", "rl_s", "total_s"} <= set(report.timings)


def test_metrics_per_step(world) -> None:
    _, outputs = world
    for out in outputs:
        for key in ("accuracy", "mean_response_tokens", "well_formed", "mean_reward",
                    "kl_to_step0", "top1_agreement_with_step0"):
            assert isinstance(out.metrics[key], float), key
        assert 0.0 <= out.metrics["top1_agreement_with_step0"] <= 1.0
    assert outputs[0].metrics["kl_to_step0"] == pytest.approx(0.0, abs=1e-6)
    assert outputs[0].metrics["top1_agreement_with_step0"] == 1.0
    rewards = [r["reward"] for r in outputs[0].records]
    groups = [rewards[i:i + CONFIG.samples_per_prompt]
              for i in range(0, len(rewards), CONFIG.samples_per_prompt)]
    assert any(len(set(g)) > 1 for g in groups), "no learning signal in the small config"
    assert outputs[1].metrics["kl_to_step0"] > 0.0  # so the first update moved the policy


def test_records_have_exact_keys_and_types(world) -> None:
    _, outputs = world
    ids = set()
    for out in outputs:
        for rec in out.records:
            assert tuple(rec) == RECORD_KEYS
            assert isinstance(rec["rollout_id"], str)
            ids.add(rec["rollout_id"])
            assert rec["trainer_step"] == out.step and type(rec["trainer_step"]) is int
            assert rec["generated_by_policy_version"] == out.step
            assert all(type(i) is int for i in rec["prompt_token_ids"])
            assert all(type(i) is int for i in rec["response_token_ids"])
            assert rec["response_token_ids"], "empty response"
            assert type(rec["reward"]) is float
            assert rec["finish_reason"] in ("stop", "length")
            assert rec["token_fidelity"] == "exact"
            roles = [m["role"] for m in rec["messages"]]
            assert roles[-1] == "assistant" and roles[-2] == "user"
            assert all(set(m) == {"role", "content"} and isinstance(m["content"], str)
                       for m in rec["messages"])
    assert len(ids) == sum(len(o.records) for o in outputs)


def test_record_ids_match_messages(world) -> None:
    _, outputs = world
    tok = AutoTokenizer.from_pretrained(outputs[0].policy_dir)
    for out in outputs:
        for rec in out.records:
            response = rec["response_token_ids"]
            assert encode_prompt(tok, rec["messages"][:-1]) == rec["prompt_token_ids"]
            stopped = rec["finish_reason"] == "stop"
            assert (response[-1] == tok.eos_token_id) == stopped
            assert tok.eos_token_id not in response[:-1]
            body = response[:-1] if stopped else response
            assert tok.decode(body) == rec["messages"][-1]["content"]


def test_reward_matches_the_task_score(world) -> None:
    _, outputs = world
    for rec in outputs[0].records:
        user = rec["messages"][-2]["content"]
        a, b = (int(x) for x in user.rstrip("?.").split()[-3::2])
        problem = task.Problem(a=a, b=b, width=CONFIG.max_digits)
        score = task.score_response(problem, rec["messages"][-1]["content"],
                                    num_tokens=len(rec["response_token_ids"]),
                                    stopped=rec["finish_reason"] == "stop",
                                    length_penalty=CONFIG.length_penalty)
        assert rec["reward"] == pytest.approx(score.reward)


def test_checkpoint_is_a_complete_hf_dir(world) -> None:
    _, outputs = world
    last = outputs[-1].policy_dir
    model = AutoModelForCausalLM.from_pretrained(last)
    tok = AutoTokenizer.from_pretrained(last)
    n = model.config.num_hidden_layers
    assert n >= 4 and all(0 <= i < n for i in (1, n // 2 - 1, n - 4))
    assert model.config.vocab_size == len(tok)
    assert "lm_head.weight" in load_file(last / "model.safetensors")
    rec = outputs[-1].records[0]
    ids = torch.tensor([rec["prompt_token_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


def test_checkpoints_differ_between_steps(world) -> None:
    _, outputs = world
    first = load_file(outputs[0].policy_dir / "model.safetensors")
    second = load_file(outputs[1].policy_dir / "model.safetensors")
    assert any(not torch.equal(first[k], second[k]) for k in first)


def test_two_runs_are_identical(world, world_again) -> None:
    (report_a, out_a), (report_b, out_b) = world, world_again
    assert [o.records for o in out_a] == [o.records for o in out_b]
    assert [o.metrics for o in out_a] == [o.metrics for o in out_b]
    for a, b in zip(out_a, out_b, strict=True):
        wa = load_file(a.policy_dir / "model.safetensors")
        wb = load_file(b.policy_dir / "model.safetensors")
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert (a.policy_dir / "tokenizer.json").read_bytes() == \
            (b.policy_dir / "tokenizer.json").read_bytes()
    assert report_a.steps == report_b.steps
