"""The adapter tests' world: the demo tokenizer and an untrained demo policy."""

from __future__ import annotations

import pytest

from pipeline.demo import policy
from pipeline.demo.config import DemoConfig
from pipeline.demo.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """The demo tokenizer and an untrained demo policy saved as the initial policy."""
    root = tmp_path_factory.mktemp("policy")
    config = DemoConfig.small()
    tok = train_tokenizer(vocab_size=config.vocab_size, task_examples=config.tokenizer_examples,
                          filler=config.tokenizer_filler, seed=1)
    policy.save_checkpoint(policy.build_policy(tok, config.model_shape, seed=2), tok,
                           root / "base")
    return tok, root / "base"
