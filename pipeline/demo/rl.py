"""Group-normalised REINFORCE for the demo policy.

Responsible for one RL step's pieces: sampling a group of responses per prompt, scoring
them with the task reward, normalising advantages within each group, and one policy
gradient update. The loss is ``-sum_i A_i * sum_t log p(y_it) / sum_i |y_i|`` over response
tokens (EOS included), so every sampled token of a rollout shares its advantage.

The tiny policy is fragile: AdamW at lr 1e-4 drifts the style choices while keeping the
arithmetic; 2e-4 already hurts accuracy and 3e-4 can break it in one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.demo import corpus, task
from pipeline.demo.generation import generate
from pipeline.demo.policy import response_text, score_generation


@dataclass(frozen=True)
class Rollout:
    """One sampled response to one prompt, with its score."""

    prompt_index: int
    sample_index: int
    problem: task.Problem
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str
    text: str
    score: task.Score


def collect_rollouts(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     problems: list[task.Problem], *, samples_per_prompt: int,
                     max_new_tokens: int, temperature: float, generator: torch.Generator,
                     length_penalty: float) -> list[Rollout]:
    """Sample ``samples_per_prompt`` responses for every problem (prompt-major order)."""
    prompt_ids = [corpus.encode_prompt(tokenizer, task.prompt_messages(p)) for p in problems]
    flat = [ids for ids in prompt_ids for _ in range(samples_per_prompt)]
    gens = generate(model, flat, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                    max_new_tokens=max_new_tokens, temperature=temperature,
                    generator=generator)
    rollouts = []
    for i, gen in enumerate(gens):
        p_idx, s_idx = divmod(i, samples_per_prompt)
        problem = problems[p_idx]
        rollouts.append(Rollout(
            prompt_index=p_idx, sample_index=s_idx, problem=problem,
            prompt_ids=prompt_ids[p_idx], response_ids=gen.token_ids,
            finish_reason=gen.finish_reason,
            text=response_text(tokenizer, gen.token_ids, gen.finish_reason),
            score=score_generation(tokenizer, problem, gen.token_ids, gen.finish_reason,
                                   length_penalty),
        ))
    return rollouts


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(G, S)`` rewards -> advantages normalised within each group (row)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def policy_gradient_loss(model: PreTrainedModel, rollouts: list[Rollout],
                         advantages: torch.Tensor, pad_id: int) -> torch.Tensor:
    """REINFORCE loss for ``rollouts`` (advantages flattened in rollout order)."""
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    ids, mask = corpus.right_pad(seqs, pad_id)  # (B, T)
    response = torch.zeros_like(mask, dtype=torch.bool)
    for row, r in enumerate(rollouts):
        start = len(r.prompt_ids)
        response[row, start:start + len(r.response_ids)] = True
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # (B, T-1, V)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    targets = response[:, 1:]  # position t predicts token t+1
    weighted = logp * advantages.view(-1, 1) * targets
    return -weighted.sum() / targets.sum().clamp(min=1)


def reinforce_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer,
                   rollouts: list[Rollout], samples_per_prompt: int, pad_id: int,
                   max_grad_norm: float = 1.0) -> float:
    """One optimizer step on ``rollouts``; returns the loss value."""
    rewards = torch.tensor([r.score.reward for r in rollouts], dtype=torch.float32)
    advantages = group_advantages(rewards.view(-1, samples_per_prompt)).flatten()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = policy_gradient_loss(model, rollouts, advantages, pad_id)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Accuracy, mean response tokens, well-formed rate and mean reward of ``rollouts``."""
    n = len(rollouts)
    return {
        "accuracy": sum(r.score.correct for r in rollouts) / n,
        "mean_response_tokens": sum(len(r.response_ids) for r in rollouts) / n,
        "well_formed": sum(r.score.well_formed for r in rollouts) / n,
        "mean_reward": sum(r.score.reward for r in rollouts) / n,
    }
