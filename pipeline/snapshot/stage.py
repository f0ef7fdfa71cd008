"""Rollout snapshots: the writer an RL trainer calls once per step, and the validating reader.

Layout (``step=NNNNNN`` is the RL step):

- ``policies/step=NNNNNN/``  the policy checkpoint that generated the rollouts
- ``rollouts/step=NNNNNN/``  what the trainer handed in: ``part-*.parquet`` (records that
  passed the writer's checks), ``quarantine.parquet`` and ``_manifest.json`` (written last:
  the completion marker)
- ``snapshots/step=NNNNNN/`` the validated snapshot: ``accepted-*.parquet``,
  ``quarantine.parquet`` (writer and reader rejections) and ``_manifest.json``

Nothing is ever dropped silently: every record handed in is accepted or quarantined with
its field and reason, and ``records_in == accepted + quarantined`` is checked on both sides.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.contracts import FileEntry, Manifest
from pipeline.layout import ROLLOUTS, committed_steps, raw_prefix, snapshot_prefix
from pipeline.manifest import entry_for, read_manifest, verify_manifest, write_manifest
from pipeline.parquet import ParquetFileError, read_table, write_table
from pipeline.snapshot.policy import load_policy_ref, publish_policy
from pipeline.snapshot.schema import (
    DEFAULT_LIMITS,
    ROLLOUT_SCHEMA,
    ROLLOUT_SCHEMA_VERSION,
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


class _Sieve:
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


def _write_chunks(storage: Storage, prefix: str, stem: str, records: Iterator[dict[str, Any]],
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


def _write_quarantine(storage: Storage, prefix: str, rejections: list[dict]) -> FileEntry:
    table = pa.Table.from_pylist(rejections, schema=QUARANTINE_SCHEMA)
    written = write_table(storage, f"{prefix}/quarantine.parquet", table)
    return entry_for(prefix, written, rows=table.num_rows)


class SnapshotWriter:
    """What an RL trainer calls once per step: records plus the policy checkpoint dir."""

    def __init__(self, storage: Storage, *, limits: Limits = DEFAULT_LIMITS,
                 rows_per_file: int = 4096):
        self.storage, self.limits, self.rows_per_file = storage, limits, rows_per_file

    def write_step(self, step: int, records: Iterable[Mapping[str, Any]], policy_dir: Path,
                   policy_version: int) -> SnapshotSummary:
        """Publish the policy, then the records, then the completion marker.

        Records lacking ``policy_uri`` get the published checkpoint's URI. Rejected records
        go to ``quarantine.parquet`` with their reason; a re-run rewrites the same names.
        """
        policy = publish_policy(self.storage, step, policy_dir)
        sieve = _Sieve("writer", policy.vocab_size, step, self.limits)
        prefix = raw_prefix(step)

        def accepted() -> Iterator[dict[str, Any]]:
            for row, raw in enumerate(records):
                if isinstance(raw, Mapping) and "policy_uri" not in raw:
                    raw = {**raw, "policy_uri": policy.uri}
                rec = sieve.check(raw, "writer input", row)
                if rec is not None:
                    yield rec

        parts = _write_chunks(self.storage, prefix, "part", accepted(), self.rows_per_file)
        quarantine = _write_quarantine(self.storage, prefix, sieve.rejections)
        summary = SnapshotSummary(
            step=step, url=self.storage.url(prefix), records_in=sieve.accepted + len(
                sieve.rejections), accepted=sieve.accepted, quarantined=len(sieve.rejections),
            reasons=_reason_counts(sieve.rejections), tokens=sieve.tokens, policy_uri=policy.uri)
        write_manifest(self.storage, prefix, Manifest(
            kind=RAW_KIND, kind_version=ROLLOUT_SCHEMA_VERSION, files=(*parts, quarantine),
            meta=_summary_meta(summary) | {
                "policy_version": policy_version, "policy_sha256": policy.sha256,
                "tokenizer_fingerprint": policy.tokenizer_fingerprint}))
        if summary.quarantined:
            log.warning("step %d: quarantined %d of %d records: %s", step, summary.quarantined,
                        summary.records_in, summary.reasons)
        return summary


def _reason_counts(rejections: list[dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(f"{r['field']}: {_reason_class(r['reason'])}" for r in rejections))


def _reason_class(reason: str) -> str:
    """Collapse per-record details (indices, values) so reasons aggregate into counts."""
    for marker in ("duplicate of", "outside the tokenizer's range", "absurd length",
                   "invalid UTF-8", "expected", "empty", "missing", "unknown"):
        if marker in reason:
            return marker
    return reason


def _summary_meta(s: SnapshotSummary) -> dict[str, Any]:
    return {"step": s.step, "records_in": s.records_in, "accepted": s.accepted,
            "quarantined": s.quarantined, "reasons": s.reasons, "tokens": s.tokens,
            "policy_uri": s.policy_uri}


def completed_steps(storage: Storage) -> list[int]:
    """Steps whose raw snapshot carries a completion marker, ascending (one listing)."""
    return committed_steps(storage.list(ROLLOUTS), ROLLOUTS)


def run(storage: Storage, step: int, *, limits: Limits = DEFAULT_LIMITS,
                      rows_per_file: int = 4096) -> SnapshotSummary:
    """Re-validate a written snapshot and publish the validated copy.

    Raises :class:`SnapshotError` when the snapshot is incomplete, a file is corrupt or
    truncated (the message names the file), or the counts do not add up.
    """
    prefix = raw_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        raise SnapshotError(f"{storage.url(prefix)}: no completion marker; step not finished")
    problems = verify_manifest(storage, prefix, manifest)
    if problems:
        raise SnapshotError("corrupt snapshot: " + "; ".join(problems))
    policy = load_policy_ref(storage, step)
    sieve = _Sieve("reader", policy.vocab_size, step, limits)
    parts = [f for f in manifest.files if f.path != "quarantine.parquet"]
    try:
        writer_rejections = read_table(storage, f"{prefix}/quarantine.parquet",
                                       QUARANTINE_SCHEMA).to_pylist()
        out_prefix = snapshot_prefix(step)
        accepted = _write_chunks(storage, out_prefix, "accepted",
                                 _reread(storage, prefix, parts, sieve), rows_per_file)
    except ParquetFileError as e:
        raise SnapshotError(str(e)) from e
    rejections = writer_rejections + sieve.rejections
    quarantine = _write_quarantine(storage, out_prefix, rejections)
    summary = SnapshotSummary(
        step=step, url=storage.url(out_prefix), records_in=manifest.meta["records_in"],
        accepted=sieve.accepted, quarantined=len(rejections),
        reasons=_reason_counts(rejections), tokens=sieve.tokens, policy_uri=policy.uri)
    if summary.accepted + summary.quarantined != summary.records_in:
        raise SnapshotError(f"{storage.url(prefix)}: {summary.records_in} records written but "
                            f"{summary.accepted} accepted + {summary.quarantined} quarantined")
    write_manifest(storage, out_prefix, Manifest(
        kind=VALIDATED_KIND, kind_version=ROLLOUT_SCHEMA_VERSION, files=(*accepted, quarantine),
        meta=_summary_meta(summary) | {k: manifest.meta[k] for k in (
            "policy_version", "policy_sha256", "tokenizer_fingerprint")}))
    return summary


def _reread(storage: Storage, prefix: str, parts: list[FileEntry],
            sieve: _Sieve) -> Iterator[dict[str, Any]]:
    for part in parts:
        key = f"{prefix}/{part.path}"
        table = read_table(storage, key)
        table = table.cast(_strings_as_binary(table.schema))  # invalid UTF-8 caught per record
        row = 0
        for batch in table.to_batches(max_chunksize=1024):
            for raw in batch.to_pylist():
                rec = sieve.check(raw, storage.url(key), row)
                row += 1
                if rec is not None:
                    yield rec


def read_accepted(storage: Storage, step: int) -> pa.Table:
    """The accepted records of a validated snapshot (small steps; stream for large ones)."""
    prefix = snapshot_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None:
        raise SnapshotError(f"{storage.url(prefix)}: snapshot not validated yet")
    tables = [read_table(storage, f"{prefix}/{f.path}", ROLLOUT_SCHEMA)
              for f in manifest.files if f.path.startswith("accepted-")]
    return pa.concat_tables(tables)


def _strings_as_binary(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_type(_binary_type(f.type)) for f in schema],
                     metadata=schema.metadata)


def _binary_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.binary()
    if pa.types.is_list(t):
        return pa.list_(_binary_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_binary_type(t.field(i).type))
                          for i in range(t.num_fields)])
    return t
