"""Acceptance statistics of speculative decoding, kept as summed counts.

A *cycle* is one draft–verify round: the drafter proposes a tree (or chain) of draft tokens
after the last verified token, the target verifies all of them in one forward pass, and the
cycle emits the accepted draft tokens plus one *bonus* token (the target's own prediction
after the last accepted one). The first generated token of a prompt comes from the target's
prefill, not from a cycle.

Definitions (over all cycles of all prompts):

- **τ (tau)**, the mean acceptance length: tokens emitted by cycles ÷ cycles. Accepted draft
  tokens plus the bonus token, so τ = 1 with no drafter or a useless one and
  τ = num_steps + 1 when every draft is accepted. The prefill token is not counted
  (SGLang's ``completion_tokens / spec_verify_ct`` does count it: that ratio is
  :attr:`AcceptanceStats.server_accept_length`).
- **α_k**, the acceptance rate at draft position k (k = 0 is the first draft token after the
  verified root): accepts_k ÷ attempts_k, where attempts_k counts the cycles whose
  verification reached position k (positions 0..k-1 all accepted and position k offered at
  least one draft token) and accepts_k those that accepted a token there. Undefined (NaN)
  when no cycle reached position k.
- **Accept-length histogram**: ``accept_hist[a]`` cycles emitted exactly ``a`` draft tokens.

Truncation: a cycle that runs into EOS or ``max_new_tokens`` emits only what fits; only
emitted tokens count, and positions past the truncation count neither as attempts nor as
accepts (the cycle stopped before judging them).

Invariants: every field is a sum over cycles (or prompts), so stats of any grouping of
prompts merge to exactly the stats of one run over all of them; ratios are computed only from
the sums. ``emitted_tokens == Σ a·accept_hist[a] + bonus_tokens``. JSON round trip via
:meth:`to_dict`/:meth:`from_dict`, no pickle.

Counted by a serving engine (:meth:`AcceptanceStats.from_totals`): an engine reports, per
request, its verify passes and generated tokens, not what each pass accepted. Such a record
has ``positions_observed`` False: cycles, emitted and prefill tokens are the engine's, the
histogram, the per-position counts and ``bonus_tokens`` stay zero (unknown, not zero
acceptance), and α is NaN at every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

STATS_SCHEMA_VERSION = 1
_COUNT_FIELDS = ("prompts", "cycles", "emitted_tokens", "bonus_tokens", "prefill_tokens")
_LIST_FIELDS = ("accept_hist", "position_attempts", "position_accepts")
_TIME_FIELDS = ("prefill_seconds", "draft_seconds", "verify_seconds")


@dataclass
class AcceptanceStats:
    """Summed acceptance counts and timings for drafts of depth ``num_steps`` (0: no drafter)."""

    num_steps: int
    prompts: int = 0
    cycles: int = 0
    emitted_tokens: int = 0  # by cycles: accepted drafts + bonus tokens
    bonus_tokens: int = 0
    prefill_tokens: int = 0  # first tokens, one per prompt
    accept_hist: list[int] = field(default_factory=list)  # (num_steps + 1,)
    position_attempts: list[int] = field(default_factory=list)  # (num_steps,)
    position_accepts: list[int] = field(default_factory=list)  # (num_steps,)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # drafter: draft extend + tree drafting
    verify_seconds: float = 0.0  # target: tree verification forward + cache bookkeeping
    schema_version: int = STATS_SCHEMA_VERSION
    positions_observed: bool = True  # False: totals counted by an engine (module docstring)

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        sizes = {"accept_hist": self.num_steps + 1, "position_attempts": self.num_steps,
                 "position_accepts": self.num_steps}
        for name, size in sizes.items():
            value = getattr(self, name)
            if not value:
                setattr(self, name, [0] * size)
            elif len(value) != size:
                raise ValueError(f"{name} has {len(value)} entries, expected {size} for "
                                 f"num_steps={self.num_steps}")
        if not self.positions_observed:
            if any(self.accept_hist) or any(self.position_attempts) \
                    or any(self.position_accepts) or self.bonus_tokens:
                raise ValueError("totals counted by an engine carry no per-cycle counts")
            if not 0 <= self.emitted_tokens <= self.cycles * (self.num_steps + 1):
                raise ValueError(f"{self.emitted_tokens} tokens from {self.cycles} cycles: "
                                 f"more than num_steps + 1 = {self.num_steps + 1} each")
        elif self.emitted_tokens != sum(a * n for a, n in enumerate(self.accept_hist)) \
                + self.bonus_tokens:
            raise ValueError("emitted_tokens disagrees with accept_hist and bonus_tokens")

    @classmethod
    def from_totals(cls, num_steps: int, *, prompts: int, cycles: int, emitted_tokens: int
                    ) -> AcceptanceStats:
        """What an engine counted: ``cycles`` verify passes emitted ``emitted_tokens`` after
        the prefill token of each of ``prompts`` requests (module docstring)."""
        return cls(num_steps, prompts=prompts, cycles=cycles, emitted_tokens=emitted_tokens,
                   prefill_tokens=prompts, positions_observed=False)

    # -- recording ---------------------------------------------------------------------
    def add_cycle(self, accepted: int, attempted: int, bonus: bool) -> None:
        """One cycle that emitted ``accepted`` draft tokens (+ the bonus token if ``bonus``)
        after judging draft positions ``0..attempted-1``."""
        if not 0 <= accepted <= attempted <= self.num_steps or attempted > accepted + 1:
            raise ValueError(f"inconsistent cycle: accepted={accepted}, attempted={attempted}, "
                             f"num_steps={self.num_steps}")
        self.cycles += 1
        self.emitted_tokens += accepted + int(bonus)
        self.bonus_tokens += int(bonus)
        self.accept_hist[accepted] += 1
        for k in range(attempted):
            self.position_attempts[k] += 1
            self.position_accepts[k] += int(k < accepted)

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """A new record with the sums of both (same ``num_steps`` required)."""
        if other.num_steps != self.num_steps:
            raise ValueError(f"cannot merge stats of num_steps {self.num_steps} and "
                             f"{other.num_steps}")
        if other.positions_observed != self.positions_observed:
            raise ValueError("cannot merge per-cycle counts with an engine's totals")
        out = AcceptanceStats(self.num_steps, positions_observed=self.positions_observed)
        for name in _COUNT_FIELDS + _TIME_FIELDS:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in _LIST_FIELDS:
            setattr(out, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name),
                                                      strict=True)])
        return out

    # -- derived -----------------------------------------------------------------------
    @property
    def tau(self) -> float:
        """Tokens emitted per draft–verify cycle, bonus included (NaN without cycles)."""
        return self.emitted_tokens / self.cycles if self.cycles else math.nan

    @property
    def alpha(self) -> list[float]:
        """α_k = accepts_k / attempts_k per draft position k (NaN where never reached, and
        everywhere when an engine counted only totals)."""
        return [acc / att if att else math.nan
                for acc, att in zip(self.position_accepts, self.position_attempts, strict=True)]

    @property
    def server_accept_length(self) -> float:
        """SGLang's formula, Σ completion_tokens / Σ spec_verify_ct (prefill token counted)."""
        total = self.emitted_tokens + self.prefill_tokens
        return total / self.cycles if self.cycles else math.nan

    @property
    def accept_length_histogram(self) -> dict[int, float]:
        """Fraction of cycles that emitted exactly ``a`` draft tokens, for each ``a`` (NaN
        when an engine counted only totals)."""
        known = self.cycles and self.positions_observed
        return {a: (n / self.cycles if known else math.nan)
                for a, n in enumerate(self.accept_hist)}

    @property
    def generated_tokens(self) -> int:
        return self.emitted_tokens + self.prefill_tokens

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.draft_seconds + self.verify_seconds

    def time_split(self) -> dict[str, float]:
        """Seconds per phase and the draft share of draft + verify time."""
        loop = self.draft_seconds + self.verify_seconds
        return {"prefill_seconds": self.prefill_seconds, "draft_seconds": self.draft_seconds,
                "verify_seconds": self.verify_seconds,
                "draft_fraction": self.draft_seconds / loop if loop else math.nan,
                "tokens_per_second": (self.generated_tokens / self.total_seconds
                                      if self.total_seconds else math.nan)}

    def summary(self) -> dict[str, Any]:
        """Derived metrics, JSON-safe (None where undefined), e.g. for MLflow or metadata."""
        def clean(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 6)

        return {"tau": clean(self.tau), "alpha": [clean(a) for a in self.alpha],
                "server_accept_length": clean(self.server_accept_length),
                "cycles": self.cycles, "generated_tokens": self.generated_tokens,
                "prompts": self.prompts,
                **{k: clean(v) for k, v in self.time_split().items()}}

    # -- serialisation -----------------------------------------------------------------
    def counts(self) -> dict[str, Any]:
        """Every count, no timings: equal for equal work however prompts were grouped."""
        return {name: getattr(self, name)
                for name in ("num_steps",) + _COUNT_FIELDS + _LIST_FIELDS
                + ("positions_observed",)}
