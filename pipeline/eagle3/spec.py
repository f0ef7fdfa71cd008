"""Speculative-decoding parameters, with SGLang's rules (DESIGN §5; SGLang 0.5.21–0.5.23).

The three numbers are SGLang's server flags:

- ``num_steps`` (``--speculative-num-steps``): draft depth, i.e. draft-model steps per cycle;
- ``eagle_topk`` (``--speculative-eagle-topk``): branching factor; 1 drafts a chain;
- ``num_draft_tokens`` (``--speculative-num-draft-tokens``): nodes verified per cycle, the
  root (the last verified token) included, so ``num_draft_tokens - 1`` draft tokens.

Invariants (checked on construction; errors name the offending field):

- all three are integers ``>= 1``, ``num_draft_tokens >= 2``;
- ``eagle_topk == 1`` implies ``num_draft_tokens == num_steps + 1`` (a chain verifies all its
  tokens). SGLang silently *adjusts* this at launch; constructing a ``SpecParams`` refuses it,
  :meth:`SpecParams.resolve` mirrors the server and adjusts with a warning;
- ``num_draft_tokens - 1 <= eagle_topk + (num_steps - 1) * eagle_topk**2``: SGLang picks the
  verified nodes with ``torch.topk`` over that many candidates (``eagle_topk`` at depth 1, then
  ``eagle_topk**2`` children of the ``eagle_topk`` kept nodes at every further step).

Defaults when none of the three is given (SGLang's ``_auto_choose_speculative_params``):
``(5, 4, 8)`` for Llama (and Grok) targets, ``(3, 1, 4)`` for every other architecture.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# architectures[0] -> SGLang's auto defaults; everything else gets FALLBACK_DEFAULTS.
AUTO_DEFAULTS: Mapping[str, tuple[int, int, int]] = {
    "LlamaForCausalLM": (5, 4, 8),
    "Grok1ForCausalLM": (5, 4, 8),
    "Grok1VForCausalLM": (5, 4, 8),
}
FALLBACK_DEFAULTS = (3, 1, 4)
FIELDS = ("num_steps", "eagle_topk", "num_draft_tokens")


@dataclass(frozen=True)
class SpecParams:
    """SGLang's ``(num_steps, eagle_topk, num_draft_tokens)``; see the module docstring."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (the root plus at least one "
                             f"draft token), got {self.num_draft_tokens}")
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"num_draft_tokens must equal num_steps + 1 = "
                             f"{self.num_steps + 1} when eagle_topk is 1 (a chain), got "
                             f"{self.num_draft_tokens}")
        if self.num_draft_tokens - 1 > self.max_candidates:
            raise ValueError(f"num_draft_tokens - 1 = {self.num_draft_tokens - 1} exceeds the "
                             f"{self.max_candidates} candidates that num_steps="
                             f"{self.num_steps}, eagle_topk={self.eagle_topk} draft")

    @property
    def max_candidates(self) -> int:
        """Draft candidates per cycle: ``topk`` at depth 1, ``topk**2`` at each deeper step."""
        return self.eagle_topk + (self.num_steps - 1) * self.eagle_topk ** 2

    # -- construction ------------------------------------------------------------------
    @classmethod
    def auto_for(cls, architecture: str | Sequence[str] | None) -> SpecParams:
        """SGLang's defaults for a target whose ``config.architectures`` is ``architecture``."""
        if architecture is not None and not isinstance(architecture, str):
            architecture = architecture[0] if len(architecture) else None
        return cls(*AUTO_DEFAULTS.get(architecture or "", FALLBACK_DEFAULTS))

    @classmethod
    def resolve(cls, num_steps: int | None = None, eagle_topk: int | None = None,
                num_draft_tokens: int | None = None, *,
                architecture: str | Sequence[str] | None = None) -> SpecParams:
        """What an SGLang server launched with these flags runs: all three or none.

        None of them: :meth:`auto_for` ``architecture``. A chain whose ``num_draft_tokens``
        is not ``num_steps + 1`` is adjusted (with a warning), as the server does.
        """
        given = {"num_steps": num_steps, "eagle_topk": eagle_topk,
                 "num_draft_tokens": num_draft_tokens}
        missing = [name for name, value in given.items() if value is None]
        if len(missing) == len(FIELDS):
            return cls.auto_for(architecture)
        if missing:
            raise ValueError(f"set all of num_steps, eagle_topk, num_draft_tokens or none; "
                             f"missing {', '.join(missing)}")
        assert num_steps is not None and num_draft_tokens is not None
        if eagle_topk == 1 and num_draft_tokens != num_steps + 1:
            logger.warning("num_draft_tokens %s adjusted to num_steps + 1 = %s for "
                           "eagle_topk 1 (as SGLang does)", num_draft_tokens, num_steps + 1)
            num_draft_tokens = num_steps + 1
        return cls(num_steps, eagle_topk, num_draft_tokens)  # type: ignore[arg-type]

    # -- views -------------------------------------------------------------------------
    def sglang_args(self) -> list[str]:
        """The server flags that run these parameters."""
        return ["--speculative-num-steps", str(self.num_steps),
                "--speculative-eagle-topk", str(self.eagle_topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens)]
