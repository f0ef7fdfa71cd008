"""The demo RL world: plays the user's RL trainer, one step at a time.

Responsible for the whole run: train the tokenizer, pretrain the policy, then for every RL
step ``s``: the current policy (version ``s``, i.e. after ``s`` updates) samples the step's
rollouts, is saved as an HF checkpoint ``policy/step-{s:06d}/``, is measured (greedy
accuracy and drift vs step 0 on held-out prompts), is handed to ``on_step``, and only then
updated. Everything is seeded; with the same config, thread count and deterministic
algorithms, two runs give identical records and identical checkpoint weights.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline.demo import corpus, drift, policy, rl, task
from pipeline.demo.config import DemoConfig
from pipeline.demo.generation import generate
from pipeline.demo.tokenizer import save_tokenizer, train_tokenizer
from pipeline.records import to_json

__all__ = ["RECORD_KEYS", "DemoConfig", "StepOutput", "WorldReport", "generate_world", "run_rl"]

logger = logging.getLogger(__name__)

RECORD_KEYS: tuple[str, ...] = (
    "rollout_id", "trainer_step", "generated_by_policy_version", "messages",
    "prompt_token_ids", "response_token_ids", "reward", "finish_reason", "token_fidelity",
)


@dataclass(frozen=True)
class StepOutput:
    """What one RL step hands to the snapshot writer."""

    step: int
    policy_version: int
    policy_dir: Path
    records: list[dict[str, Any]]
    metrics: dict[str, float]
    sampling: dict[str, Any]  # how the rollouts were sampled (SGLang's names)


@dataclass
class WorldReport:
    """Summary of a run: per-step metrics, the pretrained policy's quality and timings."""

    config: dict[str, Any]
    vocab_size: int
    num_parameters: int
    tokenizer_dir: str  # relative to the world's work dir
    pretrained: dict[str, float]
    steps: list[dict[str, float]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def derive_seed(seed: int, *tags: object) -> int:
    """A stable 63-bit seed for one purpose (str seeding hashes with SHA-512)."""
    return random.Random("/".join(map(str, (seed, *tags)))).getrandbits(63)


def to_records(rollouts: list[rl.Rollout], step: int) -> list[dict[str, Any]]:
    """Plain-dict rollout records (exactly :data:`RECORD_KEYS`) for step ``step``."""
    records = []
    for r in rollouts:
        messages = [*task.prompt_messages(r.problem), {"role": "assistant", "content": r.text}]
        records.append({
            "rollout_id": f"step{step:06d}-p{r.prompt_index:03d}-s{r.sample_index}",
            "trainer_step": step,
            "generated_by_policy_version": step,
            "messages": messages,
            "prompt_token_ids": list(r.prompt_ids),
            "response_token_ids": list(r.response_ids),
            "reward": float(r.score.reward),
            "finish_reason": r.finish_reason,
            "token_fidelity": "exact",
        })
    return records


def _held_out(model: PreTrainedModel, reference: PreTrainedModel, tok: PreTrainedTokenizerBase,
              problems: list[task.Problem], prompts: list[list[int]],
              config: DemoConfig) -> dict[str, float]:
    """Greedy quality of ``model`` on held-out prompts and its drift vs ``reference``."""
    gens = generate(model, prompts, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                    max_new_tokens=config.max_new_tokens, temperature=0.0)
    scores = [policy.score_generation(tok, p, g.token_ids, g.finish_reason,
                                      config.length_penalty)
              for p, g in zip(problems, gens, strict=True)]
    d = drift.measure_drift(model, reference, prompts, [g.token_ids for g in gens],
                            tok.pad_token_id)
    n = len(scores)
    return {
        "greedy_accuracy": sum(s.correct for s in scores) / n,
        "greedy_well_formed": sum(s.well_formed for s in scores) / n,
        "greedy_response_tokens": sum(s.num_tokens for s in scores) / n,
        "kl_to_step0": d.kl,
        "top1_agreement_with_step0": d.top1_agreement,
    }


def generate_world(config: DemoConfig, work_dir: Path, on_step: Callable[[StepOutput], None],
                   progress: bool = True) -> WorldReport:
    """Run the demo world into ``work_dir`` and hand every step to ``on_step``."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _run(config, work_dir, on_step, progress)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def run_rl(config: DemoConfig, tok: PreTrainedTokenizerBase, model: PreTrainedModel,
           work_dir: Path, on_step: Callable[[StepOutput], None],
           progress: bool) -> list[dict[str, float]]:
    """The RL phase: ``config.num_steps`` steps from the pretrained ``model`` (updated in place).

    Returns the per-step metrics.
    """
    reference = copy.deepcopy(model).eval()
    held_out = policy.evaluation_problems(config.eval_prompts, derive_seed(config.seed, "eval"),
                                          config.min_digits, config.max_digits)
    held_prompts = [corpus.encode_prompt(tok, task.prompt_messages(p)) for p in held_out]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.rl_lr, betas=(0.9, 0.999),
                                  weight_decay=0.0)
    steps = []
    for step in tqdm(range(config.num_steps), desc="rl", disable=not progress, leave=False):
        rng = random.Random(derive_seed(config.seed, "prompts", step))
        problems = [task.sample_problem(rng, config.min_digits, config.max_digits)
                    for _ in range(config.prompts_per_step)]
        generator = torch.Generator().manual_seed(derive_seed(config.seed, "sample", step))
        shifted = config.shift_step is not None and step >= config.shift_step
        for group in optimizer.param_groups:
            group["lr"] = config.shift_rl_lr if shifted else config.rl_lr
        rollouts = rl.collect_rollouts(
            model, tok, problems, samples_per_prompt=config.samples_per_prompt,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            generator=generator,
            length_penalty=config.shift_length_penalty if shifted else config.length_penalty)
        policy_dir = work_dir / "policy" / f"step-{step:06d}"
        policy.save_checkpoint(model, tok, policy_dir)
        metrics = {**rl.rollout_metrics(rollouts),
                   **_held_out(model, reference, tok, held_out, held_prompts, config)}
        steps.append({"step": step, **metrics})
        logger.info("step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
        on_step(StepOutput(step=step, policy_version=step, policy_dir=policy_dir,
                           records=to_records(rollouts, step), metrics=metrics,
                           sampling={"temperature": config.temperature}))
        rl.reinforce_step(model, optimizer, rollouts, config.samples_per_prompt,
                          tok.pad_token_id)
    return steps


def _run(config: DemoConfig, work_dir: Path, on_step: Callable[[StepOutput], None],
         progress: bool) -> WorldReport:
    t_start, cpu_start = time.perf_counter(), time.process_time()
    tok = train_tokenizer(vocab_size=config.vocab_size, task_examples=config.tokenizer_examples,
                          filler=config.tokenizer_filler, seed=derive_seed(config.seed, "tok"),
                          long_prob=config.long_prob)
    save_tokenizer(tok, str(work_dir / "tokenizer"))
    t_tok = time.perf_counter()
    logger.info("tokenizer: %d tokens in %.1fs", len(tok), t_tok - t_start)

    model = policy.build_policy(tok, config.model_shape, seed=derive_seed(config.seed, "init"))
    policy.pretrain(model, tok, steps=config.pretrain_steps, batch_size=config.pretrain_batch,
                    lr=config.pretrain_lr, seed=derive_seed(config.seed, "pretrain"),
                    long_prob=config.long_prob, min_digits=config.min_digits,
                    max_digits=config.max_digits, progress=progress)
    t_pre = time.perf_counter()
    report = WorldReport(
        config=asdict(config), vocab_size=len(tok),
        num_parameters=sum(p.numel() for p in model.parameters()),
        tokenizer_dir="tokenizer", pretrained={})
    report.steps = run_rl(config, tok, model, work_dir, on_step, progress)
    report.pretrained = {k.removeprefix("greedy_"): report.steps[0][k] for k in
                         ("greedy_accuracy", "greedy_well_formed", "greedy_response_tokens")}
    t_end = time.perf_counter()
    report.timings = {"tokenizer_s": t_tok - t_start, "pretrain_s": t_pre - t_tok,
                      "rl_s": t_end - t_pre, "total_s": t_end - t_start,
                      "cpu_s": time.process_time() - cpu_start}
    (work_dir / "report.json").write_text(to_json(report))
    return report
