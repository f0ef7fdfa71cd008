"""Decisions about a registered drafter version, as MLflow version tags.

A decision (the gate's, or a manual override's) is a :class:`DecisionRecord`: what, why, by
whom, when, against which champion and in which Dagster run. Decision ``n`` of a version is
one JSON tag ``gate.<n>``, written once and never rewritten; the decision that counts, its
standing, is ``gate.decision`` (promoted | forced | refused | canary) with ``gate.decision_id`` = n.

Versions registered before this layout kept one tag per field (``gate.<n>.decision``,
``gate.<n>.reasons``, …) and copies of the standing's fields (``gate.reasons``, …):
:func:`decision_in` and :func:`decision_numbers` read both layouts.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.release.lineage import MAX_TAG_VALUE, parse_tag

PROMOTED, FORCED, REFUSED = "promoted", "forced", "refused"
CANARY = "canary"  # the gate passed it to serve part of the servers first (release.canary)
DECISIONS = (PROMOTED, FORCED, REFUSED, CANARY)
STANDING = "gate.decision"
STANDING_ID = "gate.decision_id"
LEGACY_STANDING = ("gate.reasons", "gate.decided_at", "gate.baseline", "gate.relative_gain")
_ENTRY = re.compile(r"^gate\.(\d+)(\.decision)?$")  # gate.<n>; gate.<n>.decision before it


@dataclass(frozen=True)
class DecisionRecord:
    """One decision about a registered version: what, why, by whom, against which champion.

    ``baseline``: ``champion`` | ``no-drafter`` for the gate's decisions, ``override`` for a
    forced promotion; ``champion``: the version serving when it was decided (None: none).
    """

    decision: str  # promoted | forced | refused | canary
    reasons: tuple[str, ...]
    actor: str
    decided_at: str
    baseline: str
    relative_gain: float  # NaN when not measured (a forced promotion) or not comparable
    champion: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.decision not in DECISIONS:
            raise ValueError(f"decision {self.decision!r} is not one of {DECISIONS}")
        object.__setattr__(self, "reasons", tuple(self.reasons))

    def to_tag(self) -> str:
        """The record as one tag value: compact JSON (``relative_gain`` NaN is null,
        ``champion`` None is ``none``, no ``run_id``: absent; reasons cut to
        :data:`MAX_TAG_VALUE` characters)."""
        out: dict[str, Any] = {
            "decision": self.decision, "reasons": _reasons(self.reasons), "actor": self.actor,
            "decided_at": self.decided_at, "baseline": self.baseline,
            "relative_gain": (self.relative_gain if math.isfinite(self.relative_gain)
                              else None),
            "champion": self.champion or "none"}
        if self.run_id:
            out["run_id"] = self.run_id
        return json.dumps(out, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_tag(cls, text: str) -> DecisionRecord:
        entry = json.loads(text)
        gain = entry.get("relative_gain")
        return cls._of(entry, [str(r) for r in entry.get("reasons", [])],
                       math.nan if gain is None else float(gain))

    @classmethod
    def _of(cls, entry: Mapping[str, Any], reasons: Sequence[str], gain: float
            ) -> DecisionRecord:
        champion = entry.get("champion", "none")
        return cls(decision=entry["decision"], reasons=tuple(reasons),
                   actor=entry.get("actor", ""), decided_at=entry.get("decided_at", ""),
                   baseline=entry.get("baseline", ""), relative_gain=gain,
                   champion=None if champion == "none" else champion,
                   run_id=entry.get("run_id"))

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> DecisionRecord:
        """A decision kept one tag per field (``gate.<n>.*``, before :meth:`to_tag`)."""
        reasons = parse_tag(tags.get("reasons", "[]"))
        return cls._of(tags, reasons if isinstance(reasons, list) else [str(reasons)],
                       float(parse_tag(tags.get("relative_gain", "nan"))))


def decision_numbers(tags: Mapping[str, str]) -> list[int]:
    """The numbers of the decisions a version's ``tags`` hold, in either layout."""
    return sorted({int(m.group(1)) for k in tags if (m := _ENTRY.match(k))})


def decision_in(tags: Mapping[str, str], n: int) -> DecisionRecord:
    """Decision ``n`` of a version's ``tags``, in either layout (module docstring)."""
    if f"gate.{n}" in tags:
        return DecisionRecord.from_tag(tags[f"gate.{n}"])
    prefix = f"gate.{n}."
    return DecisionRecord.from_tags({k[len(prefix):]: v for k, v in tags.items()
                                     if k.startswith(prefix)})


def _reasons(reasons: Sequence[str]) -> list[str]:
    """``reasons`` cut so that their JSON stays within :data:`MAX_TAG_VALUE` characters."""
    out: list[str] = []
    used = 2
    for reason in reasons:
        room = MAX_TAG_VALUE - used - 4
        if room <= 3:
            break
        text = reason if len(reason) <= room else reason[:room - 3] + "..."
        out.append(text)
        used += len(json.dumps(text, ensure_ascii=False)) + 1
    return out
