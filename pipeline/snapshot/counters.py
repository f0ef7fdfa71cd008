"""What a rollout's speculative counters say the verify passes emitted: one definition for
the record contract (:mod:`.schema`) and observed acceptance (:mod:`pipeline.monitor.observed`).
No heavy import: the asset definitions load the monitor's module."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def emitted_by_passes(spec: Mapping[str, Any]) -> int:
    """Tokens the verify passes emitted: ``completion_tokens - 1`` where the engine counts
    completion tokens (the prefill token is no pass's), else ``accepted_tokens +
    verify_ct`` (each pass adds its own token to the drafts it accepted)."""
    if spec.get("completion_tokens") is not None:
        return max(int(spec["completion_tokens"]) - 1, 0)
    return int(spec["accepted_tokens"]) + int(spec["verify_ct"])
