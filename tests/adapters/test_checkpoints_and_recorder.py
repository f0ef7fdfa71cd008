"""Which checkpoint a step publishes, what of a checkpoint dir is the policy, and the set-ups
the TRL recorder refuses rather than record wrongly (no training here: see test_trl_grpo)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.adapters.checkpoints import policy_checkpoint
from pipeline.adapters.trl import TRLRecorder, TRLRecorderError, sampling_of
from pipeline.snapshot.policy import is_policy_file, tokenizer_fingerprint
from pipeline.storage import Storage


def _ckpt(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_the_exact_checkpoint_else_the_newest_before_else_the_initial(tmp_path):
    initial = _ckpt(tmp_path / "base")
    for n in (2, 4, 10):
        _ckpt(tmp_path / "out" / f"checkpoint-{n}")
    (tmp_path / "out" / "checkpoint-6").mkdir()  # being written: no config.json yet
    (tmp_path / "out" / "checkpoint-8").mkdir()  # the config written, the weights not yet
    (tmp_path / "out" / "checkpoint-8" / "config.json").write_text("{}")
    found = {v: policy_checkpoint(tmp_path / "out", "checkpoint-{N}", v, initial)
             for v in (0, 1, 2, 3, 6, 8, 10, 11)}
    assert {v: c.version for v, c in found.items()} == {0: 0, 1: 0, 2: 2, 3: 2, 6: 4, 8: 4,
                                                        10: 10, 11: 10}
    assert found[0].path == initial and found[3].path.name == "checkpoint-2"
    with pytest.raises(FileNotFoundError, match="no policy checkpoint for version 1"):
        policy_checkpoint(tmp_path / "out", "checkpoint-{N}", 1, None)


def test_nested_patterns_match_the_framework_layout(tmp_path):
    for n in (1, 3):
        _ckpt(tmp_path / f"global_step_{n}" / "actor" / "huggingface")
    config_only = tmp_path / "global_step_2" / "actor" / "huggingface"  # verl's default
    config_only.mkdir(parents=True)  # save_contents without hf_model: the config, no weights
    (config_only / "config.json").write_text("{}")
    found = policy_checkpoint(tmp_path, "global_step_{N}/actor/huggingface", 2, None)
    assert (found.version, found.path) == (1, tmp_path / "global_step_1/actor/huggingface")
    for n in (0, 4):  # slime: the policy after N steps is saved under rollout N - 1
        _ckpt(tmp_path / "slime" / f"{n}")
    assert [policy_checkpoint(tmp_path / "slime", "{N}", v, tmp_path / "slime" / "0",
                              shift=-1).version for v in (0, 1, 4, 5, 7)] == [0, 1, 1, 5, 5]
    with pytest.raises(ValueError, match="exactly one"):
        policy_checkpoint(tmp_path, "step_{N}_{N}", 2, None)


def test_trainer_resume_state_is_not_part_of_the_policy():
    kept = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors",
            "tokenizer.json", "chat_template.jinja", "generation_config.json"]
    dropped = ["optimizer.pt", "scheduler.pt", "rng_state.pth", "rng_state_3.pth",
               "trainer_state.json", "training_args.bin", "global_step12/mp_rank_00.pt",
               "latest", "zero_to_fp32.py"]
    assert all(map(is_policy_file, kept)) and not any(map(is_policy_file, dropped))


def test_one_template_fingerprints_the_same_in_the_config_or_its_own_file():
    tok, template = b'{"model": {}}', "{{ bos_token }}{% for m in messages %}..."
    in_config = {"tokenizer.json": tok,
                 "tokenizer_config.json": json.dumps({"chat_template": template}).encode()}
    in_file = {"tokenizer.json": tok, "tokenizer_config.json": b"{}",
               "chat_template.jinja": template.encode()}
    other = {**in_file, "chat_template.jinja": b"{{ messages }}"}
    assert tokenizer_fingerprint(in_config) == tokenizer_fingerprint(in_file)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(in_file)


class _Tok:
    eos_token_id = 9

    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": [1] + [len(m["content"]) for m in messages] + [2]}


@pytest.fixture
def recorder(tmp_path):
    def accuracy(prompts, completions, completion_ids, **_):
        return [1.0, None]

    def brevity(prompts, completions, completion_ids, **_):
        return [-0.5, -0.25]

    return TRLRecorder(Storage(tmp_path.as_uri()), tokenizer=_Tok(), initial_policy_dir=tmp_path,
                       reward_funcs=[accuracy, brevity], reward_weights=[1.0, 2.0])


def test_records_carry_trls_weighted_reward_and_the_finish_reason(recorder):
    prompt = [{"role": "user", "content": "2+2?"}]
    records = recorder.records(
        3, [prompt, prompt], [[{"role": "assistant", "content": "4"}]] * 2,
        [[5, 9], [5, 6]], [[1.0, None], [-0.5, -0.25]])
    assert [r["reward"] for r in records] == [0.0, -0.5]  # None is skipped, as TRL's nansum
    assert [r["finish_reason"] for r in records] == ["stop", "length"]
    assert records[0]["prompt_token_ids"] == [1, 4, 2]
    assert records[0]["messages"][-1] == {"role": "assistant", "content": "4"}
    assert [f.__name__ for f in recorder.reward_funcs] == ["accuracy", "brevity"]


def test_tool_calling_completions_are_refused(recorder):
    with pytest.raises(TRLRecorderError, match="tool-result tokens"):
        recorder.records(0, [[{"role": "user", "content": "x"}]], [[
            {"role": "assistant", "content": "<call>"}, {"role": "tool", "content": "7"},
            {"role": "assistant", "content": "7"}]], [[5, 9]], [[1.0], [1.0]])


@pytest.mark.parametrize("args, match", [
    (SimpleNamespace(world_size=2, eval_strategy="no"), "2 processes"),
    (SimpleNamespace(world_size=1, eval_strategy="steps"), "eval_strategy='steps'"),
])
def test_setups_that_would_record_wrongly_are_refused(recorder, args, match):
    with pytest.raises(TRLRecorderError, match=match):
        recorder.callback.on_train_begin(args, None, None)


def test_a_batch_is_written_only_once_every_function_scored_it(recorder, monkeypatch):
    written = []
    monkeypatch.setattr(recorder, "_write", lambda kwargs, per_func: written.append(per_func))
    kwargs = {"prompts": ["p", "q"], "completions": ["a", "b"], "completion_ids": [[5], [6]],
              "trainer_state": SimpleNamespace(global_step=0)}
    recorder.reward_funcs[1](**kwargs)
    assert written == []
    recorder.reward_funcs[0](**kwargs)
    assert written == [[[1.0, None], [-0.5, -0.25]]]


def test_sampling_follows_trls_config():
    assert sampling_of(SimpleNamespace(temperature=0.7, top_p=0.9, top_k=0, min_p=None)) == \
        {"temperature": 0.7, "top_p": 0.9}
    assert sampling_of(SimpleNamespace(temperature=1.0, top_p=1.0, top_k=20, min_p=0.05)) == \
        {"temperature": 1.0, "top_p": 1.0, "top_k": 20, "min_p": 0.05}
