"""GRPO with TRL, each generation batch recorded as an Aerie snapshot.

The Aerie part of a TRL script is :func:`recorded_trainer`: wrap the reward functions with
a :class:`~pipeline.adapters.trl.TRLRecorder` and attach its callback. Everything else is
plain TRL. Run it on any causal LM directory with a chat template (one process, CPU or one
GPU; ``eval_strategy`` stays ``no``)::

    export AERIE_STORAGE_URL=file://$PWD/.aerie/storage   # or s3://bucket/prefix
    python examples/trl_grpo.py --model /path/to/model --output-dir trl-out --max-steps 10

then let Aerie pick the steps up (``aerie demo``'s instance, or your Dagster deployment:
the snapshot sensor ingests ``rollouts/raw/step=N`` and the refresh sensor refreshes every
N steps). ``save_steps=1`` keeps every step's policy (``checkpoint-N``); with a larger
value a step is recorded with the newest checkpoint saved before it.

``tests/adapters/test_trl_grpo.py`` runs :func:`recorded_trainer` on the demo policy.
"""

from __future__ import annotations

import argparse
import os
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from pipeline.adapters.trl import TRLRecorder
from pipeline.storage import Storage


def recorded_trainer(model_dir: str | Path, tokenizer: Any, dataset: Dataset,
                     reward_funcs: Sequence[Callable[..., Any]], args: GRPOConfig,
                     storage: Storage, trainer_cls: type[GRPOTrainer] = GRPOTrainer
                     ) -> tuple[GRPOTrainer, TRLRecorder]:
    """A TRL GRPO trainer whose generation batches Aerie records (the whole change)."""
    recorder = TRLRecorder(storage, tokenizer=tokenizer, initial_policy_dir=model_dir,
                           reward_funcs=reward_funcs, reward_weights=args.reward_weights)
    trainer = trainer_cls(model=str(model_dir), reward_funcs=recorder.reward_funcs, args=args,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[recorder.callback])
    return trainer, recorder


def sums(n: int, seed: int = 0) -> Dataset:
    """``n`` two-number additions as chat prompts, with the answer in a column."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? "
                                                           "Answer with the number."}],
                     "answer": str(a + b)})
    return Dataset.from_list(rows)


def correct(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
    """1 when the completion's last number is the answer (TRL passes dataset columns)."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        out.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a local HF model directory")
    p.add_argument("--output-dir", default="trl-out")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=256)
    a = p.parse_args(argv)
    url = os.environ.get("AERIE_STORAGE_URL")
    if not url:
        p.error("set AERIE_STORAGE_URL to the Aerie storage root (file:///... or s3://...)")
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    args = GRPOConfig(output_dir=a.output_dir, max_steps=a.max_steps, save_steps=1,
                      per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=64, report_to="none")
    trainer, _ = recorded_trainer(a.model, tokenizer, sums(a.prompts), [correct], args,
                                  Storage(url))
    trainer.train()


if __name__ == "__main__":
    main()
