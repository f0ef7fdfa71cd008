"""The demo policy: a tiny Llama, its pretraining, evaluation and HF checkpoints.

Responsible for building the ``LlamaForCausalLM`` (untied lm_head, so a checkpoint carries
``lm_head.weight`` like a real target model), supervised pretraining on the task corpus,
greedy evaluation, and writing complete HF checkpoint directories (config, safetensors
weights, generation config and the tokenizer files) that load with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

With N layers the EAGLE-3 default aux layers are ``[1, N//2 - 1, N - 4]``, so N >= 4.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from pipeline.demo import corpus, task
from pipeline.demo.generation import generate
from pipeline.demo.tokenizer import save_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """Size of the policy network."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 512


@dataclass(frozen=True)
class EvalResult:
    """Greedy evaluation of a policy on a fixed problem set."""

    accuracy: float
    well_formed: float
    mean_response_tokens: float


def build_policy(tokenizer: PreTrainedTokenizerBase, shape: ModelShape,
                 seed: int) -> LlamaForCausalLM:
    """A freshly initialised policy (seeded) sized for ``tokenizer``'s vocab."""
    if shape.num_layers < 4:
        raise ValueError("EAGLE-3 aux layers [1, N//2-1, N-4] need at least 4 layers")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def pretrain(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, *, steps: int,
             batch_size: int, lr: float, seed: int, long_prob: float, min_digits: int,
             max_digits: int, warmup: int = 50, progress: bool = True) -> list[float]:
    """Supervised pretraining on sampled answers (loss on the assistant turn only).

    AdamW with linear warmup and cosine decay to 10% of ``lr``. Returns per-step losses.
    """
    batches = corpus.pretraining_batches(
        tokenizer, steps=steps, batch_size=batch_size, seed=seed, long_prob=long_prob,
        min_digits=min_digits, max_digits=max_digits)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    bar = tqdm(batches, desc="pretrain", disable=not progress, leave=False)
    for batch in bar:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    labels=batch.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    logger.info("pretrained %d steps, final loss %.4f", steps, losses[-1])
    return losses


def evaluation_problems(n: int, seed: int, min_digits: int, max_digits: int) -> list[task.Problem]:
    """A fixed, seeded set of held-out problems."""
    rng = random.Random(seed)
    return [task.sample_problem(rng, min_digits, max_digits) for _ in range(n)]


def evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase,
             problems: list[task.Problem], max_new_tokens: int,
             length_penalty: float = 0.03) -> EvalResult:
    """Greedy accuracy, well-formed rate and mean response length on ``problems``."""
    prompts = [corpus.encode_prompt(tokenizer, task.prompt_messages(p)) for p in problems]
    gens = generate(model, prompts, eos_id=tokenizer.eos_token_id,
                    pad_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
                    temperature=0.0)
    scores = [score_generation(tokenizer, p, g.token_ids, g.finish_reason, length_penalty)
              for p, g in zip(problems, gens, strict=True)]
    n = len(scores)
    return EvalResult(
        accuracy=sum(s.correct for s in scores) / n,
        well_formed=sum(s.well_formed for s in scores) / n,
        mean_response_tokens=sum(s.num_tokens for s in scores) / n,
    )


def response_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int],
                  finish_reason: str) -> str:
    """The assistant message content for response ids (the final EOS dropped)."""
    body = token_ids[:-1] if finish_reason == "stop" else token_ids
    return tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def score_generation(tokenizer: PreTrainedTokenizerBase, problem: task.Problem,
                     token_ids: list[int], finish_reason: str,
                     length_penalty: float) -> task.Score:
    """Score response ids with the task's reward."""
    text = response_text(tokenizer, token_ids, finish_reason)
    return task.score_response(problem, text, num_tokens=len(token_ids),
                               stopped=finish_reason == "stop", length_penalty=length_penalty)


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase,
                    directory: Path) -> None:
    """Write a complete HF checkpoint dir (safetensors + tokenizer) atomically.

    Files are written to a sibling temp dir that is renamed into place, so a reader never
    sees a half-written checkpoint; an existing ``directory`` is replaced.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per tiny checkpoint is noise
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, str(tmp))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
