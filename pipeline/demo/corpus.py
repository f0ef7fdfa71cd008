"""Token-level data for the demo policy: prompt encoding and the pretraining batches.

Responsible for turning task problems into token ids with the chat template, and for the
pretraining stream (seeded, length-bucketed batches with a loss mask on the assistant turn,
its end-of-turn token included). Prompt ids are always the chat template rendered with
``add_generation_prompt=True`` and tokenized without adding specials; the tokenizer
guarantees these are a prefix of the full conversation's ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from pipeline.demo import task


@dataclass(frozen=True)
class Batch:
    """Right-padded pretraining batch; every tensor is ``(B, T)``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # -100 outside the assistant turn and on padding


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Ids the policy is fed for ``messages``: template plus the assistant header."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_examples(tokenizer: PreTrainedTokenizerBase, problems: list[task.Problem],
                    answers: list[str]) -> list[tuple[list[int], int]]:
    """``(ids, prompt_length)`` for each full conversation (prompt + answer + EOT)."""
    prompts, fulls = [], []
    for problem, answer in zip(problems, answers, strict=True):
        messages = task.prompt_messages(problem)
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True))
        fulls.append(tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": answer}], tokenize=False))
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(fulls, add_special_tokens=False)["input_ids"]
    return [(full, len(prompt)) for full, prompt in zip(full_ids, prompt_ids, strict=True)]


def right_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``sequences`` into ``(ids, attention_mask)``, both ``(B, T)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


def pretraining_batches(tokenizer: PreTrainedTokenizerBase, *, steps: int, batch_size: int,
                        seed: int, long_prob: float, min_digits: int, max_digits: int,
                        bucket: int = 16) -> list[Batch]:
    """``steps`` batches of freshly sampled conversations, bucketed by length.

    Examples are shuffled, cut into groups of ``bucket`` batches, sorted by length inside
    each group (less padding), and the batches are shuffled again.
    """
    rng = random.Random(seed)
    problems = [task.sample_problem(rng, min_digits, max_digits)
                for _ in range(steps * batch_size)]
    answers = [task.render_answer(p, task.sample_choices(p, rng, long_prob)) for p in problems]
    examples = encode_examples(tokenizer, problems, answers)
    group = bucket * batch_size
    ordered: list[tuple[list[int], int]] = []
    for start in range(0, len(examples), group):
        ordered.extend(sorted(examples[start:start + group], key=lambda e: len(e[0])))
    chunks = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    rng.shuffle(chunks)
    batches = []
    for chunk in chunks:
        ids, mask = right_pad([ids for ids, _ in chunk], tokenizer.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        for row, (_, prompt_len) in enumerate(chunk):
            labels[row, :prompt_len] = -100
        batches.append(Batch(input_ids=ids, attention_mask=mask, labels=labels))
    return batches
