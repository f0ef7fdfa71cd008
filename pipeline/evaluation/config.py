"""What the evaluation stage measures (:class:`EvalConfig`).

Torch-free, so that Dagster run config can mirror it without loading torch with the
definitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.eagle3.spec import SpecParams


@dataclass(frozen=True)
class EvalConfig:
    """What is measured: prompt count, generation length and SGLang's speculative settings.

    ``num_steps``/``eagle_topk``/``num_draft_tokens``: all three or none (None: SGLang's
    auto choice for the target's architecture, DESIGN §5). ``reference_prompts``: how many
    prompts (the longest) are also decoded by the independent cache-free reference.
    """

    max_prompts: int = 32
    max_new_tokens: int = 128
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    reference_prompts: int = 4

    def __post_init__(self) -> None:
        if self.max_prompts < 1 or self.max_new_tokens < 1 or self.reference_prompts < 1:
            raise ValueError("max_prompts, max_new_tokens and reference_prompts must be >= 1")

    def spec_params(self, architectures: Sequence[str] | None) -> SpecParams:
        given = (self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if all(v is None for v in given):
            return SpecParams.auto_for(architectures)
        if any(v is None for v in given):
            raise ValueError("set num_steps, eagle_topk and num_draft_tokens together, or none")
        return SpecParams(*given)
