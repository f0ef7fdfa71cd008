"""Record-by-record validation shared by the snapshot writer and the snapshot stage.

A :class:`Sieve` checks each record against the contract (:mod:`.schema`), remembers ids
(duplicates) and keeps every rejection with its field and reason; rejected records are
written to ``quarantine.parquet``, accepted ones to Parquet parts. Nothing is dropped:
``records_in == accepted + quarantined`` on both sides.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.contracts import FileEntry
from pipeline.manifest import entry_for
from pipeline.parquet import write_table
from pipeline.snapshot.schema import (
    ROLLOUT_SCHEMA,
    Limits,
    RecordError,
    record_to_json,
    validate_record,
)
from pipeline.storage import Storage

log = logging.getLogger(__name__)

RAW_KIND = "rollout_snapshot_raw"
VALIDATED_KIND = "rollout_snapshot"
QUARANTINE_SCHEMA = pa.schema([
    ("stage", pa.string()), ("source", pa.string()), ("row", pa.int64()),
    ("rollout_id", pa.string()), ("field", pa.string()), ("reason", pa.string()),
    ("record_json", pa.string()),
])


class SnapshotError(RuntimeError):
    """A snapshot cannot be read as a whole (incomplete, corrupt file, miscounted)."""


@dataclass(frozen=True)
class SnapshotSummary:
    """Counts of one pass over a step's records."""

    step: int
    url: str
    records_in: int
    accepted: int
    quarantined: int
    reasons: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    policy_uri: str = ""


class Sieve:
    """Validates records one by one, remembering ids (duplicates) and rejections."""

    def __init__(self, stage: str, vocab_size: int, step: int, limits: Limits):
        self.stage, self.vocab_size, self.step, self.limits = stage, vocab_size, step, limits
        self.first_seen: dict[str, str] = {}
        self.rejections: list[dict[str, Any]] = []
        self.accepted = 0
        self.tokens = 0

    def check(self, raw: Any, source: str, row: int) -> dict[str, Any] | None:
        try:
            rec = validate_record(raw, vocab_size=self.vocab_size, step=self.step,
                                  limits=self.limits)
            where = self.first_seen.get(rec["rollout_id"])
            if where is not None:
                raise RecordError("rollout_id", f"duplicate of {where}")
        except RecordError as e:
            self.rejections.append({
                "stage": self.stage, "source": source, "row": row,
                "rollout_id": _best_effort_id(raw), "field": e.field, "reason": e.reason,
                "record_json": record_to_json(raw)})
            return None
        self.first_seen[rec["rollout_id"]] = f"{source} row {row}"
        self.accepted += 1
        self.tokens += len(rec["prompt_token_ids"] or ()) + len(rec["response_token_ids"] or ())
        return rec


def _best_effort_id(raw: Any) -> str | None:
    value = raw.get("rollout_id") if isinstance(raw, Mapping) else None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    return value.encode("utf-8", "backslashreplace").decode() if isinstance(value, str) else None


def write_chunks(storage: Storage, prefix: str, stem: str, records: Iterator[dict[str, Any]],
                  rows_per_file: int) -> list[FileEntry]:
    entries, chunk, index = [], [], 0

    def flush() -> None:
        nonlocal chunk, index
        table = pa.Table.from_pylist(chunk, schema=ROLLOUT_SCHEMA)
        written = write_table(storage, f"{prefix}/{stem}-{index:05d}.parquet", table)
        entries.append(entry_for(prefix, written, rows=table.num_rows))
        chunk, index = [], index + 1

    for rec in records:
        chunk.append(rec)
        if len(chunk) == rows_per_file:
            flush()
    if chunk or not entries:
        flush()
    return entries


def write_quarantine(storage: Storage, prefix: str, rejections: list[dict]) -> FileEntry:
    table = pa.Table.from_pylist(rejections, schema=QUARANTINE_SCHEMA)
    written = write_table(storage, f"{prefix}/quarantine.parquet", table)
    return entry_for(prefix, written, rows=table.num_rows)


def reason_counts(rejections: list[dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(f"{r['field']}: {_reason_class(r['reason'])}" for r in rejections))


def _reason_class(reason: str) -> str:
    """Collapse per-record details (indices, values) so reasons aggregate into counts."""
    for marker in ("duplicate of", "outside the tokenizer's range", "absurd length",
                   "invalid UTF-8", "expected", "empty", "missing", "unknown"):
        if marker in reason:
            return marker
    return reason


def summary_meta(s: SnapshotSummary) -> dict[str, Any]:
    return {"step": s.step, "records_in": s.records_in, "accepted": s.accepted,
            "quarantined": s.quarantined, "reasons": s.reasons, "tokens": s.tokens,
            "policy_uri": s.policy_uri}
