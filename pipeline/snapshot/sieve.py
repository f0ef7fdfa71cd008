"""Record-by-record validation shared by the snapshot writer and the snapshot stage.

A :class:`Sieve` checks each record against the contract (:mod:`.schema`), remembers ids
(duplicates) and keeps every rejection with its field and reason; rejected records are
written to ``quarantine.parquet``, accepted ones to Parquet parts. Nothing is dropped:
``records_in == accepted + quarantined`` on both sides.

A record can only ever be quarantined, never fail the step: whatever reading it raises
(short of ``BaseException``-only interrupts) becomes a rejection naming the exception type.
What a rejection quotes (field, reason, rollout id) is bounded (:func:`~.render.quote`), and
so is the number of distinct reasons counted in a manifest (:data:`MAX_REASONS`); the whole
record is kept only in the quarantine's ``record_json``.
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
from pipeline.snapshot.render import quote, record_to_json, safe_repr, type_name
from pipeline.snapshot.schema import (
    ROLLOUT_SCHEMA,
    Limits,
    RecordError,
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
MAX_REASONS = 32  # distinct reasons counted in a manifest; the rest are summed as OTHER
OTHER = "other reasons"


class SnapshotError(RuntimeError):
    """A snapshot cannot be read as a whole (incomplete, corrupt file, miscounted, written
    by an incompatible release) or a step cannot be written; the message names the file.

    ``url`` and ``field`` are set where the error is about one file (and one field of it).
    """

    def __init__(self, message: str, *, url: str | None = None, field: str | None = None):
        super().__init__(message)
        self.url, self.field = url, field


class StepArgumentError(SnapshotError, ValueError):
    """``write_step`` was called with arguments no step can have (nothing is written)."""


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
    policy_uri: str = ""  # storage key of the policy checkpoint


@dataclass(frozen=True)
class Refused:
    """A record its adapter refuses (e.g. multi-turn text without token masks): handed to
    the writer in its place, it is quarantined with this field and reason like any other."""

    record: Mapping[str, Any]
    field: str
    reason: str


class Sieve:
    """Validates records one by one, remembering ids (duplicates) and rejections."""

    def __init__(self, stage: str, vocab_size: int, step: int, limits: Limits):
        self.stage, self.vocab_size, self.step, self.limits = stage, vocab_size, step, limits
        self.first_seen: dict[str, str] = {}
        self.rejections: list[dict[str, Any]] = []
        self.accepted = 0
        self.tokens = 0

    def check(self, raw: Any, source: str, row: int,
              defaults: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The validated record, or None after quarantining it with its field and reason."""
        try:
            rec = validate_record(raw, vocab_size=self.vocab_size, step=self.step,
                                  limits=self.limits, defaults=defaults)
            where = self.first_seen.get(rec["rollout_id"])
            if where is not None:
                raise RecordError("rollout_id", f"duplicate of {where}")
        except RecordError as e:
            self.reject(raw, source, row, e.field, e.reason)
            return None
        except Exception as e:  # a record that raises while being read is still a record
            self.reject(raw, source, row, "<record>",
                        f"unreadable: {type_name(e)}: {quote(safe_repr(e), 100)}")
            return None
        self.first_seen[rec["rollout_id"]] = f"{source} row {row}"
        self.accepted += 1
        self.tokens += len(rec["prompt_token_ids"] or ()) + len(rec["response_token_ids"] or ())
        return rec

    def reject(self, raw: Any, source: str, row: int, field: str, reason: str) -> None:
        """Quarantine ``raw``: the whole record in ``record_json``, the rest quoted."""
        self.rejections.append({
            "stage": self.stage, "source": source, "row": row,
            "rollout_id": _best_effort_id(raw), "field": quote(field), "reason": quote(reason),
            "record_json": record_to_json(raw)})


def _best_effort_id(raw: Any) -> str | None:
    """The record's rollout id as far as it can be read, quoted; None when it cannot."""
    try:
        value = raw.get("rollout_id") if isinstance(raw, Mapping) else None
        if isinstance(value, bytes | bytearray):
            value = bytes(value).decode("utf-8", errors="backslashreplace")
        return quote(value) if isinstance(value, str) else None
    except Exception:  # the record is quarantined for what it raises; the id is optional
        return None


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
    """Rejections counted by field and reason class: the :data:`MAX_REASONS` - 1 most common
    and, when there are more, the rest summed under :data:`OTHER`."""
    counts = Counter(f"{quote(r['field'] or '')}: {_reason_class(quote(r['reason'] or ''))}"
                     for r in rejections)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(ranked) <= MAX_REASONS:
        return dict(ranked)
    kept = dict(ranked[: MAX_REASONS - 1])
    return kept | {OTHER: sum(n for _, n in ranked[MAX_REASONS - 1 :])}


def _reason_class(reason: str) -> str:
    """Collapse per-record details (indices, values) so reasons aggregate into counts."""
    for marker in ("duplicate of", "outside the tokenizer's range", "absurd length",
                   "invalid UTF-8", "unreadable", "expected", "empty", "missing", "unknown",
                   "beyond the int64 range"):
        if marker in reason:
            return marker
    return reason


def summary_meta(s: SnapshotSummary) -> dict[str, Any]:
    return {"step": s.step, "records_in": s.records_in, "accepted": s.accepted,
            "quarantined": s.quarantined, "reasons": s.reasons, "tokens": s.tokens,
            "policy_uri": s.policy_uri}
