"""Stage 1, ``rollout_snapshot``: re-validate what a trainer wrote and commit it.

Layout (``step=NNNNNN`` is the RL step; see :mod:`pipeline.layout`):

- ``policies/step=NNNNNN/``  the policy checkpoint that generated the rollouts
- ``rollouts/step=NNNNNN/``  what the trainer handed in (:mod:`.writer`): ``part-*.parquet``,
  ``quarantine.parquet`` and ``_manifest.json`` (written last: the completion marker)
- ``snapshots/step=NNNNNN/`` the validated snapshot: ``accepted-*.parquet``,
  ``quarantine.parquet`` (writer and reader rejections) and ``_manifest.json``

Nothing is ever dropped silently: every record handed in is accepted or quarantined with
its field and reason, and ``records_in == accepted + quarantined`` is checked on both sides.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from pipeline.contracts import FileEntry, Manifest
from pipeline.layout import ROLLOUTS, committed_steps, raw_prefix, snapshot_prefix
from pipeline.manifest import read_manifest, verify_manifest, write_manifest
from pipeline.parquet import ParquetFileError, read_table
from pipeline.snapshot.policy import load_policy_ref
from pipeline.snapshot.schema import (
    DEFAULT_LIMITS,
    ROLLOUT_SCHEMA,
    ROLLOUT_SCHEMA_VERSION,
    Limits,
)
from pipeline.snapshot.sieve import (
    QUARANTINE_SCHEMA,
    VALIDATED_KIND,
    Sieve,
    SnapshotError,
    SnapshotSummary,
    reason_counts,
    summary_meta,
    write_chunks,
    write_quarantine,
)
from pipeline.storage import Storage

log = logging.getLogger(__name__)


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
    sieve = Sieve("reader", policy.vocab_size, step, limits)
    parts = [f for f in manifest.files if f.path != "quarantine.parquet"]
    try:
        writer_rejections = read_table(storage, f"{prefix}/quarantine.parquet",
                                       QUARANTINE_SCHEMA).to_pylist()
        out_prefix = snapshot_prefix(step)
        accepted = write_chunks(storage, out_prefix, "accepted",
                                 _reread(storage, prefix, parts, sieve), rows_per_file)
    except ParquetFileError as e:
        raise SnapshotError(str(e)) from e
    rejections = writer_rejections + sieve.rejections
    quarantine = write_quarantine(storage, out_prefix, rejections)
    summary = SnapshotSummary(
        step=step, url=storage.url(out_prefix), records_in=manifest.meta["records_in"],
        accepted=sieve.accepted, quarantined=len(rejections),
        reasons=reason_counts(rejections), tokens=sieve.tokens, policy_uri=policy.uri)
    if summary.accepted + summary.quarantined != summary.records_in:
        raise SnapshotError(f"{storage.url(prefix)}: {summary.records_in} records written but "
                            f"{summary.accepted} accepted + {summary.quarantined} quarantined")
    write_manifest(storage, out_prefix, Manifest(
        kind=VALIDATED_KIND, kind_version=ROLLOUT_SCHEMA_VERSION, files=(*accepted, quarantine),
        meta=summary_meta(summary) | {k: manifest.meta[k] for k in (
            "policy_version", "policy_sha256", "tokenizer_fingerprint")}))
    return summary


def _reread(storage: Storage, prefix: str, parts: list[FileEntry],
            sieve: Sieve) -> Iterator[dict[str, Any]]:
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
