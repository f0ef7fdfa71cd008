"""Unit tests of batched generation, group advantages, the RL loss and drift metrics."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.demo.drift import measure_drift
from pipeline.demo.generation import generate
from pipeline.demo.rl import group_advantages
from tests.families import tiny_llama

EOS, PAD = 3, 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(0, vocab=40, hidden=32, layers=4, heads=2, max_positions=128,
                      tie_word_embeddings=False)


PROMPTS = [[0, 5, 6, 7, 8, 9, 10], [0, 11], [0, 12, 13, 14]]


def test_batched_greedy_matches_one_by_one(model: LlamaForCausalLM) -> None:
    batched = generate(model, PROMPTS, eos_id=EOS, pad_id=PAD, max_new_tokens=12,
                       temperature=0.0)
    for prompt, gen in zip(PROMPTS, batched, strict=True):
        alone = generate(model, [prompt], eos_id=EOS, pad_id=PAD, max_new_tokens=12,
                         temperature=0.0)[0]
        assert gen == alone
        # greedy = argmax of a plain full forward at every step
        ids = list(prompt)
        for token in gen.token_ids:
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert int(logits.argmax()) == token
            ids.append(token)


def test_sampling_is_reproducible_and_needs_a_generator(model: LlamaForCausalLM) -> None:
    def run(seed: int) -> list:
        return generate(model, PROMPTS, eos_id=EOS, pad_id=PAD, max_new_tokens=20,
                        temperature=1.0, generator=torch.Generator().manual_seed(seed))

    assert run(1) == run(1)
    assert run(1) != run(2)
    with pytest.raises(ValueError):
        generate(model, PROMPTS, eos_id=EOS, pad_id=PAD, max_new_tokens=4, temperature=1.0)


def test_finish_reasons(model: LlamaForCausalLM) -> None:
    gens = generate(model, PROMPTS, eos_id=EOS, pad_id=PAD, max_new_tokens=30,
                    temperature=2.0, generator=torch.Generator().manual_seed(0))
    for gen in gens:
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] == EOS and EOS not in gen.token_ids[:-1]
        else:
            assert len(gen.token_ids) == 30 and EOS not in gen.token_ids


def test_group_advantages_normalise_within_groups() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [3.0, 3.0, 3.0, 3.0]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert adv[0].std(unbiased=False) == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(adv[1], torch.zeros(4))  # no signal in a tied group
    assert adv[0, 0] > adv[0, 2] > adv[0, 1]


def test_drift_is_zero_against_itself_and_positive_after_a_change(
        model: LlamaForCausalLM) -> None:
    responses = [g.token_ids for g in generate(model, PROMPTS, eos_id=EOS, pad_id=PAD,
                                               max_new_tokens=8, temperature=0.0)]
    same = measure_drift(model, model, PROMPTS, responses, PAD)
    assert same.kl == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    assert same.positions == sum(len(r) for r in responses)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.add_(torch.randn_like(moved.lm_head.weight))
    drift = measure_drift(moved, model, PROMPTS, responses, PAD)
    assert drift.kl > 0.01 and drift.top1_agreement < 1.0
