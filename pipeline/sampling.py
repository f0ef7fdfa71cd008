"""The sampler an RL engine decodes rollouts with: :class:`SamplingParams` (torch-free).

An RL step's rollouts are sampled (temperature around 1, often top-p/top-k), and a draft
token's acceptance depends on how the target samples, so the settings travel with the data:
the snapshot writer records them per step (``sampling`` in the step's manifest meta), the
evaluation measures τ at the newest step's settings, and every acceptance report names them.

Conventions are SGLang's ``sampling_params``:

- ``temperature`` >= 0; below 1e-6 is greedy (argmax), whatever the other fields say;
- ``top_p`` in (0, 1], 1 keeps every token;
- ``top_k`` >= 1, or -1 for every token (0 and None are read as -1, as vLLM writes it);
  ``top_k`` 1 is greedy too (SGLang's ``is_all_greedy``);
- ``min_p`` in [0, 1], 0 keeps every token. Recorded, but SGLang's EAGLE verification does
  not apply it (``docs/speculative-sampling.md``), so neither does Aerie's measurement.

:meth:`SamplingParams.from_mapping` is the contract check: unknown keys and bad values raise
:class:`SamplingError` naming the field. :meth:`canonical` folds every greedy setting into
one, so that two greedy runs compare equal whatever top-p they listed.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

FIELDS = ("temperature", "top_p", "top_k", "min_p")
GREEDY_BELOW = 1e-6  # SGLang rewrites a smaller temperature to greedy


MAX_TOP_K = 2**31 - 1  # the engines' int32; any vocabulary is smaller


def _shown(value: Any) -> str:
    """``value`` for an error message, an absurd integer by its digit count."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) \
            and abs(int(value)) > 10**30:
        return f"an integer of {int(abs(int(value)).bit_length() * math.log10(2)) + 1} digits"
    return repr(value)[:80]


class SamplingError(ValueError):
    """Sampling settings violate the contract; ``field`` names the offending one."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"sampling.{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples: temperature, then top-k, top-p and min-p (module docstring)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SamplingError(name, f"expected a finite number, got {_shown(value)}")
            try:
                number = float(value)
            except OverflowError:  # an integer or fraction beyond float64
                raise SamplingError(name, f"{_shown(value)} is beyond the float64 range"
                                    ) from None
            if not math.isfinite(number):
                raise SamplingError(name, f"expected a finite number, got {_shown(value)}")
            object.__setattr__(self, name, number)
        top_k = self.top_k
        if top_k is None or (isinstance(top_k, numbers.Integral)
                             and not isinstance(top_k, bool) and top_k == 0):
            top_k = -1
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) \
                or not (top_k == -1 or 1 <= top_k <= MAX_TOP_K):
            raise SamplingError("top_k", f"expected an integer in [1, {MAX_TOP_K}], or -1 "
                                         f"(every token), got {_shown(self.top_k)}")
        object.__setattr__(self, "top_k", int(top_k))
        if self.temperature < 0:
            raise SamplingError("temperature", f"must be >= 0 (0 is greedy), got "
                                               f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"must be in [0, 1], got {self.min_p}")

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any] | SamplingParams) -> SamplingParams:
        """Settings from a trainer or a JSON record; ``temperature`` is required, unknown
        keys are refused (a typo would otherwise measure another regime); the other missing
        ones take the defaults above."""
        if isinstance(value, SamplingParams):
            return value
        if not isinstance(value, Mapping):
            raise SamplingError("*", f"expected a mapping of {', '.join(FIELDS)}, got "
                                     f"{type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in FIELDS)
        if unknown:
            raise SamplingError(unknown[0], f"unknown setting (known: {', '.join(FIELDS)})")
        if value.get("temperature") is None:
            raise SamplingError("temperature", "missing: say it (0 for greedy); SGLang and "
                                               "vLLM default to 1.0, Aerie does not guess")
        given = {k: v for k, v in value.items() if v is not None}
        return cls(**given)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def canonical(self) -> SamplingParams:
        """The same sampler with every greedy setting folded into ``SamplingParams()``."""
        return SamplingParams() if self.greedy else self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def label(self) -> str:
        """Short and readable: ``greedy`` or ``T=1 top_p=0.9 top_k=50`` (defaults left out)."""
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k != -1:
            parts.append(f"top_k={self.top_k}")
        if self.min_p > 0:
            parts.append(f"min_p={self.min_p:g}")
        return " ".join(parts)

    @property
    def slug(self) -> str:
        """The label as a metric-name part: ``greedy``, ``T1_top_p0.9``."""
        return self.label.replace("=", "").replace(" ", "_")


GREEDY = SamplingParams()


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s draws in an evaluation seeded ``seed``: independent of
    how prompts are grouped or which server decodes them (SGLang's ``sampling_seed``)."""
    digest = hashlib.sha256(f"aerie-eval:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
