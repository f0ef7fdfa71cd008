"""A real TRL GRPO run of the demo policy with Aerie's recorder attached, then a refresh on
what it wrote: the snapshot sensor ingests TRL's steps and the refresh sensor's run trains,
evaluates and gates a drafter on them.

TRL's own trainer generates (transformers ``generate``, CPU, no vLLM) and optimises; the
test keeps the trainer's tensors of every generation batch (``prompt_ids``/``prompt_mask``,
``completion_ids``/``completion_mask``, the padded tensors the loss is computed on) and
checks that the snapshot holds exactly those ids. The trainer is built by the copyable
example's :func:`examples.trl_grpo.recorded_trainer`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from aerie import cli
from aerie.demo import RefreshLoop, gate_outcome
from examples.trl_grpo import recorded_trainer
from pipeline.demo import policy, task
from pipeline.demo.config import DemoConfig
from pipeline.demo.tokenizer import train_tokenizer
from pipeline.layout import raw_prefix
from pipeline.manifest import read_manifest
from pipeline.parquet import read_table
from pipeline.storage import Storage
from resources.refresh import RefreshPolicyResource
from tests.e2e.loop import TRAIN, home_env

pytestmark = pytest.mark.integration
STEPS = 3


def _correct(prompts, completions, a, b, **_):
    """The demo task's correctness (TRL passes the dataset's columns ``a`` and ``b``)."""
    return [1.0 if task.score_response(task.Problem(x, y, width=2), c[0]["content"],
                                       num_tokens=1).correct else 0.0
            for c, x, y in zip(completions, a, b, strict=True)]


def _short(prompts, completions, completion_ids, **_):
    return [-len(ids) / 100 for ids in completion_ids]


class _Watched(GRPOTrainer):
    """TRL's trainer, keeping the tensors of every generation batch it trains on."""

    batches: list[tuple[int, dict[str, torch.Tensor]]]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.batches.append((self.state.global_step, {
            k: out[k].detach().clone() for k in
            ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}))
        return out


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    home = tmp_path_factory.mktemp("trl") / "home"
    with home_env(home):
        cli.prepare_dagster_home()
        config = DemoConfig.small()
        tok = train_tokenizer(vocab_size=config.vocab_size,
                              task_examples=config.tokenizer_examples,
                              filler=config.tokenizer_filler, seed=1, long_prob=config.long_prob)
        torch.manual_seed(0)
        model = policy.build_policy(tok, config.model_shape, seed=2)
        policy.pretrain(model, tok, steps=config.pretrain_steps, batch_size=8,
                        lr=config.pretrain_lr, seed=3, long_prob=config.long_prob,
                        min_digits=1, max_digits=2, progress=False)
        base = home / "base-policy"
        policy.save_checkpoint(model, tok, base)
        rng = random.Random(0)
        problems = [task.sample_problem(rng, 1, 2) for _ in range(64)]
        dataset = Dataset.from_list([{"prompt": task.prompt_messages(p), "a": p.a, "b": p.b}
                                     for p in problems])
        storage = Storage((home / "storage").as_uri())
        weights = [1.0, 0.5]
        args = GRPOConfig(
            output_dir=str(home / "trl-out"), max_steps=STEPS, per_device_train_batch_size=16,
            num_generations=4, max_completion_length=64, save_steps=1, use_cpu=True,
            report_to="none", learning_rate=1e-4, seed=0, reward_weights=weights,
            temperature=1.0, top_k=50, disable_tqdm=True)
        trainer, recorder = recorded_trainer(base, tok, dataset, [_correct, _short], args,
                                             storage, trainer_cls=_Watched)
        trainer.batches = []
        trainer.train()
        yield home, storage, recorder, trainer


def _records(storage: Storage, step: int) -> list[dict]:
    manifest = read_manifest(storage, raw_prefix(step))
    return [row for f in manifest.files if f.path.startswith("part")
            for row in read_table(storage, f"{raw_prefix(step)}/{f.path}").to_pylist()]


def test_trl_writes_every_generation_batch_with_the_ids_it_trained_on(grpo):
    home, storage, recorder, trainer = grpo
    assert [g for g, _ in trainer.batches] == list(range(STEPS))
    assert [s.step for s in recorder.written] == list(range(STEPS))
    for step, tensors in trainer.batches:
        records = _records(storage, step)
        assert len(records) == 16 and all(r["token_fidelity"] == "exact" for r in records)
        for row, rec in enumerate(records):
            prompt = tensors["prompt_ids"][row][tensors["prompt_mask"][row].bool()].tolist()
            completion = tensors["completion_ids"][row][
                tensors["completion_mask"][row].bool()].tolist()
            assert rec["prompt_token_ids"] == prompt, (step, row)
            # the completion mask zeroes what follows the first EOS and truncated rows are
            # masked whole when mask_truncated_completions is on (off here)
            assert rec["response_token_ids"] == completion, (step, row)
            assert (rec["trainer_step"], rec["generated_by_policy_version"]) == (step, step)
            assert rec["messages"][-1]["role"] == "assistant"


def test_each_step_publishes_the_checkpoint_that_generated_it(grpo):
    home, storage, recorder, trainer = grpo
    for step in range(STEPS):
        meta = read_manifest(storage, raw_prefix(step)).meta
        assert meta["policy_version"] == step  # checkpoint-N is the policy after N updates
        assert meta["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                    "min_p": 0.0}
    published = {p.name for p in Path(storage.path("policies/step=000001")).iterdir()}
    assert "model.safetensors" in published and "optimizer.pt" not in published


def test_a_refresh_on_trls_steps_reaches_a_gate_decision(grpo):
    home, storage, recorder, trainer = grpo
    from dagster import AssetKey, DagsterInstance
    with home_env(home):
        driver = RefreshLoop(DagsterInstance.get(), refresh_config=lambda step: TRAIN,
                             policy=RefreshPolicyResource(every=STEPS, window=STEPS))
        assert driver.after_step() == [f"step-{STEPS - 1:06d}"]
        assert driver.ingested == [f"step-{s:06d}" for s in range(STEPS)]
        gate = gate_outcome(driver.instance, f"step-{STEPS - 1:06d}")
        assert gate is not None and gate.action in ("promoted", "refused"), gate
        assert gate.candidate_tau >= 1.0
        for asset in ("drafter_checkpoint", "acceptance_eval", "registered_drafter"):
            event = driver.instance.fetch_materializations(AssetKey(asset), limit=1).records
            assert event[0].asset_materialization.metadata["window_steps"].value == \
                list(range(STEPS)), asset
