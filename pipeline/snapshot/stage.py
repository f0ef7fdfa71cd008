"""Stage 1, ``rollout_snapshot``: re-validate what a trainer wrote and commit it.

Layout (``step=NNNNNN`` is the RL step; see :mod:`pipeline.layout`):

- ``policies/step=NNNNNN/``  the policy checkpoint that generated the rollouts
- ``rollouts/step=NNNNNN/``  what the trainer handed in (:mod:`.writer`): ``part-*.parquet``,
  ``quarantine.parquet`` and ``_manifest.json`` (written last: the completion marker)
- ``snapshots/step=NNNNNN/`` the validated snapshot: ``accepted-*.parquet``,
  ``quarantine.parquet`` (writer and reader rejections) and ``_manifest.json``

Nothing is ever dropped silently: every record handed in is accepted or quarantined with
its field and reason, and ``records_in == accepted + quarantined`` is checked on both sides.
A record that cannot even be read out of its Parquet row is quarantined too; what fails a
step is a problem of its files (:mod:`.reader`: a :class:`SnapshotError` naming the file).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from pipeline.contracts import FileEntry, Manifest
from pipeline.layout import ROLLOUTS, committed_steps, raw_prefix, snapshot_prefix
from pipeline.manifest import manifest_key, verify_manifest, withdraw_manifest, write_manifest
from pipeline.sampling import SamplingError, SamplingParams
from pipeline.snapshot.policy import PolicyRef, load_policy_ref
from pipeline.snapshot.reader import (
    checked_manifest,
    meta_int,
    meta_str,
    read_part,
    refuse_problems,
    require_file,
)
from pipeline.snapshot.render import quote, safe_repr, type_name
from pipeline.snapshot.schema import (
    DEFAULT_LIMITS,
    READABLE_SCHEMA_VERSIONS,
    ROLLOUT_SCHEMA,
    ROLLOUT_SCHEMA_VERSION,
    Limits,
)
from pipeline.snapshot.sieve import (
    QUARANTINE_SCHEMA,
    RAW_KIND,
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

QUARANTINE = "quarantine.parquet"
_ACCEPTED = re.compile(r"accepted-[0-9]{5,}\.parquet")  # what write_chunks names them


def completed_steps(storage: Storage) -> list[int]:
    """Steps whose raw snapshot carries a completion marker, ascending (one listing)."""
    return committed_steps(storage.list(ROLLOUTS), ROLLOUTS)


def run(storage: Storage, step: int, *, limits: Limits = DEFAULT_LIMITS,
        rows_per_file: int = 4096) -> SnapshotSummary:
    """Re-validate a written snapshot and publish the validated copy.

    Raises :class:`SnapshotError` when the snapshot is incomplete, its manifest malformed or
    of another kind or version, a file is corrupt, truncated or of another schema version
    (the message names the file and the field), or the counts do not add up.
    """
    prefix = raw_prefix(step)
    manifest = checked_manifest(storage, prefix, RAW_KIND, READABLE_SCHEMA_VERSIONS)
    if manifest is None:
        raise SnapshotError(f"{storage.url(prefix)}: no completion marker; step not finished")
    records_in = meta_int(storage, prefix, manifest, "records_in")
    lineage = _lineage(storage, prefix, manifest, step)
    require_file(storage, prefix, manifest, QUARANTINE)
    refuse_problems(verify_manifest(storage, prefix, manifest))
    policy = load_policy_ref(storage, step)
    _same_policy(storage, prefix, lineage, policy)
    sieve = Sieve("reader", policy.vocab_size, step, limits)
    parts = [f for f in manifest.files if f.path != QUARANTINE]
    writer_rejections = _read_quarantine(storage, prefix, manifest.file(QUARANTINE))
    out_prefix = snapshot_prefix(step)
    withdraw_manifest(storage, out_prefix)
    accepted = write_chunks(storage, out_prefix, "accepted",
                            _reread(storage, prefix, parts, sieve), rows_per_file)
    rejections = writer_rejections + sieve.rejections
    quarantine = write_quarantine(storage, out_prefix, rejections)
    summary = SnapshotSummary(
        step=step, url=storage.url(out_prefix), records_in=records_in,
        accepted=sieve.accepted, quarantined=len(rejections),
        reasons=reason_counts(rejections), tokens=sieve.tokens, policy_uri=policy.key)
    if summary.accepted + summary.quarantined != summary.records_in:
        url = storage.url(manifest_key(prefix))
        raise SnapshotError(f"{url}: meta.records_in: {summary.records_in} records written but "
                            f"{summary.accepted} accepted + {summary.quarantined} quarantined",
                            url=url, field="meta.records_in")
    write_manifest(storage, out_prefix, Manifest(
        kind=VALIDATED_KIND, kind_version=ROLLOUT_SCHEMA_VERSION, files=(*accepted, quarantine),
        meta=summary_meta(summary) | lineage))
    return summary


def _lineage(storage: Storage, prefix: str, manifest: Manifest, step: int) -> dict[str, Any]:
    """The meta a snapshot carries from the policy (and the sampler) that generated it,
    type-checked."""
    lineage = {"policy_version": meta_int(storage, prefix, manifest, "policy_version",
                                          maximum=step),
               "policy_sha256": meta_str(storage, prefix, manifest, "policy_sha256"),
               "tokenizer_fingerprint": meta_str(storage, prefix, manifest,
                                                 "tokenizer_fingerprint")}
    sampler = sampling_meta(storage, prefix, manifest)
    return lineage | ({"sampling": sampler.to_dict()} if sampler is not None else {})


def sampling_meta(storage: Storage, prefix: str, manifest: Manifest) -> SamplingParams | None:
    """The sampler a snapshot manifest records (None: the trainer recorded none)."""
    value = manifest.meta.get("sampling")
    if value is None:
        return None
    try:
        return SamplingParams.from_mapping(value)
    except SamplingError as e:
        url = storage.url(manifest_key(prefix))
        raise SnapshotError(f"{url}: meta.{e}", url=url, field=f"meta.sampling.{e.field}"
                            ) from e


def recorded_sampling(storage: Storage, step: int) -> SamplingParams | None:
    """The sampler step ``step``'s validated snapshot records, or None (none recorded or
    no committed snapshot)."""
    prefix = snapshot_prefix(step)
    manifest = checked_manifest(storage, prefix, VALIDATED_KIND, READABLE_SCHEMA_VERSIONS)
    return None if manifest is None else sampling_meta(storage, prefix, manifest)


def _same_policy(storage: Storage, prefix: str, lineage: dict[str, Any],
                 policy: PolicyRef) -> None:
    """The snapshot was written against the policy checkpoint committed for its step (a
    checkpoint re-published since would make the lineage name weights the rollouts never
    came from)."""
    committed = {"policy_sha256": policy.sha256,
                 "tokenizer_fingerprint": policy.tokenizer_fingerprint}
    for name, value in committed.items():
        if lineage[name] != value:
            url = storage.url(manifest_key(prefix))
            raise SnapshotError(
                f"{url}: meta.{name} {lineage[name]!r} is not the committed checkpoint's "
                f"{value!r} ({policy.uri}); write the step again", url=url, field=name)


def _read_quarantine(storage: Storage, prefix: str, entry: FileEntry) -> list[dict[str, Any]]:
    """The writer's rejections, their quoted columns quoted again (the file may be
    foreign)."""
    table = read_part(storage, prefix, entry, claimed=False, schema=QUARANTINE_SCHEMA)
    try:
        rows = table.to_pylist()
    except (pa.ArrowException, ValueError) as e:
        url = storage.url(f"{prefix}/{entry.path}")
        raise SnapshotError(f"{url}: unreadable rows ({type_name(e)})", url=url) from e
    for row in rows:
        for name in ("rollout_id", "field", "reason"):
            if row[name] is not None:
                row[name] = quote(row[name])
    return rows


def _reread(storage: Storage, prefix: str, parts: list[FileEntry],
            sieve: Sieve) -> Iterator[dict[str, Any]]:
    for part in parts:
        url = storage.url(f"{prefix}/{part.path}")
        table = read_part(storage, prefix, part, claimed=False)
        try:  # read text as bytes: invalid UTF-8 is then caught per record
            table = table.cast(_strings_as_binary(table.schema))
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise SnapshotError(f"{url}: columns unreadable ({quote(str(e))})", url=url) from e
        row = 0
        for batch in table.to_batches(max_chunksize=1024):
            for raw, error in _rows(batch):
                if error is None:
                    rec = sieve.check(raw, url, row)
                else:
                    sieve.reject(None, url, row, "<record>", f"unreadable row: {error}")
                    rec = None
                row += 1
                if rec is not None:
                    yield rec


def _rows(batch: pa.RecordBatch) -> Iterator[tuple[Any, str | None]]:
    """The batch's rows as Python values; a row Arrow cannot convert (a date beyond
    Python's range, say) comes with the error instead."""
    try:
        rows = batch.to_pylist()
    except Exception:  # the failing rows are found one by one below
        for i in range(batch.num_rows):
            try:
                yield batch.slice(i, 1).to_pylist()[0], None
            except Exception as e:
                yield None, f"{type_name(e)}: {quote(safe_repr(e), 100)}"
        return
    for raw in rows:
        yield raw, None


def read_accepted(storage: Storage, step: int) -> pa.Table:
    """The accepted records of a validated snapshot (small steps; stream for large ones).

    The manifest must list the quarantine and accepted parts only; every file is checked
    against it (size, sha256), the parts as they are read; the parts must carry this
    release's kind and schema version and hold ``meta.accepted`` rows.
    """
    prefix = snapshot_prefix(step)
    manifest = checked_manifest(storage, prefix, VALIDATED_KIND, READABLE_SCHEMA_VERSIONS)
    if manifest is None:
        raise SnapshotError(f"{storage.url(prefix)}: snapshot not validated yet")
    expected = meta_int(storage, prefix, manifest, "accepted")
    meta_int(storage, prefix, manifest, "records_in")  # a validated manifest has both,
    _lineage(storage, prefix, manifest, step)  # and its lineage, well-typed
    require_file(storage, prefix, manifest, QUARANTINE)
    parts = [f for f in manifest.files if f.path != QUARANTINE]
    for f in parts:
        if not _ACCEPTED.fullmatch(f.path):
            url = storage.url(manifest_key(prefix))
            raise SnapshotError(f"{url}: files: {f.path} is not a file of a validated snapshot",
                                url=url, field="files")
    quarantine = dataclasses.replace(manifest, files=(manifest.file(QUARANTINE),))
    refuse_problems(verify_manifest(storage, prefix, quarantine))  # the rest while read
    tables = [read_part(storage, prefix, f, claimed=True, schema=ROLLOUT_SCHEMA) for f in parts]
    table = pa.concat_tables(tables) if tables else ROLLOUT_SCHEMA.empty_table()
    if table.num_rows != expected:
        url = storage.url(manifest_key(prefix))
        raise SnapshotError(f"{url}: meta.accepted: {expected} records, the files hold "
                            f"{table.num_rows}", url=url, field="meta.accepted")
    return table


def _strings_as_binary(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_type(_binary_type(f.type)) for f in schema],
                     metadata=schema.metadata)


def _binary_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_list(t):
        return pa.list_(_binary_type(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_binary_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_binary_type(t.field(i).type))
                          for i in range(t.num_fields)])
    return t
