"""What the engine evaluator (:mod:`.on_engine`) needs of a serving engine: one
:class:`EngineAPI` per engine (:mod:`.sglang_engine`, :mod:`.vllm_engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.eagle3.spec import SpecParams
from pipeline.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRun:
    """A drafter server's answers, in prompt order: (tokens emitted by verify passes, verify
    passes) per prompt, from the engine's own counters, and the generated ids."""

    per_prompt: tuple[tuple[int, int], ...]
    outputs: tuple[tuple[int, ...], ...]

    @property
    def passes(self) -> int:
        return sum(p for _, p in self.per_prompt)

    @property
    def emitted(self) -> int:
        return sum(e for e, _ in self.per_prompt)


class EngineAPI(Protocol):
    name: str
    recorded_args: tuple[str, ...]  # server settings the report keeps (never secrets)

    def speculative_args(self, drafter: Path, params: SpecParams) -> list[str]:
        """The launch flags that serve ``drafter`` with ``params``."""
        ...

    def server_info(self, url: str) -> dict[str, Any]:
        """What the server says of itself (its version and settings)."""
        ...

    def check_drafter(self, label: str, info: dict[str, Any], drafter: Path,
                      params: SpecParams) -> None:
        """Refuse a server that does not draft with ``drafter`` at ``params``."""
        ...

    def check_plain(self, label: str, info: dict[str, Any]) -> None:
        """Refuse a server meant to decode without a drafter that drafts."""
        ...

    def version(self, info: dict[str, Any]) -> str | None:
        ...

    def dtype(self, info: dict[str, Any]) -> str:
        """The compute dtype the server reports (``unknown`` when it does not say)."""
        ...

    def speculate(self, url: str, prompts: list[list[int]], max_new_tokens: int,
                  sampler: SamplingParams, seed: int, params: SpecParams, *,
                  concurrency: int, timeout: float) -> EngineRun:
        """Every prompt decoded with the drafter at ``params`` (an answer at other settings
        is refused), prompt i seeded from ``seed`` and i."""
        ...

    def decode(self, url: str, prompts: list[list[int]], max_new_tokens: int,
               sampler: SamplingParams, seed: int, *, concurrency: int,
               timeout: float) -> tuple[tuple[int, ...], ...]:
        """Every prompt decoded without a drafter: the generated ids."""
        ...

    def top2(self, url: str, ids: list[int], *, timeout: float
             ) -> tuple[tuple[int, float], ...]:
        """The two likeliest next tokens after ``ids`` with their log-probabilities, best
        first, as the server computes them."""
        ...
