"""Configuration of the demo RL world: one frozen dataclass, the single source of truth.

The defaults are the figures tuned on two CPU cores (see the module docs of ``world`` and
``rl``); :meth:`DemoConfig.small` is a seconds-long variant for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.demo.policy import ModelShape


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo world (seeds, sizes, steps, learning rates, threads)."""

    seed: int = 0
    threads: int = 2
    # task
    min_digits: int = 2
    max_digits: int = 3  # also the width answers are padded to
    long_prob: float = 0.55  # corpus probability of the long option at each choice point
    length_penalty: float = 0.03  # reward = correct - length_penalty * response tokens
    # tokenizer
    vocab_size: int = 1536
    tokenizer_examples: int = 4000
    tokenizer_filler: int = 20000
    # policy and pretraining
    model_shape: ModelShape = field(default_factory=ModelShape)
    pretrain_steps: int = 2000  # many small batches learn faster than few large ones
    pretrain_batch: int = 8
    pretrain_lr: float = 2e-3
    # RL
    num_steps: int = 20
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    rl_lr: float = 1e-4
    temperature: float = 1.0
    max_new_tokens: int = 160  # longest well-formed 3-digit answer is ~130 tokens
    # held-out prompts for greedy accuracy and drift
    eval_prompts: int = 64
    # a reward change mid-run (as RL runs change curricula): from ``shift_step`` on, the
    # length penalty and learning rate below, so the policy moves faster than before
    shift_step: int | None = None
    shift_length_penalty: float = 0.1
    shift_rl_lr: float = 1e-3

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError("need 1 <= min_digits <= max_digits")
        if self.samples_per_prompt < 2:
            raise ValueError("group normalisation needs samples_per_prompt >= 2")
        if self.num_steps < 1 or self.threads < 1:
            raise ValueError("num_steps and threads must be positive")

    @classmethod
    def small(cls, **overrides: object) -> DemoConfig:
        """A tiny, fast configuration (seconds) for tests and smoke runs."""
        base = cls(
            threads=1, min_digits=1, max_digits=2,
            tokenizer_examples=300, tokenizer_filler=2000, vocab_size=800,
            model_shape=ModelShape(hidden_size=32, intermediate_size=64, num_layers=4,
                                   num_heads=2, max_positions=256),
            pretrain_steps=60, pretrain_batch=8, pretrain_lr=1e-2, num_steps=3,
            prompts_per_step=3, samples_per_prompt=4, max_new_tokens=96, eval_prompts=4,
        )
        return replace(base, **overrides)
