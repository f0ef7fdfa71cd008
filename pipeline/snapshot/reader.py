"""Reading committed snapshot data back without trusting it.

A manifest or a Parquet file under ``rollouts/``, ``snapshots/`` or ``policies/`` may be
damaged, forged, or written by another release. Whatever is wrong with it is a
:class:`~.sieve.SnapshotError` whose message names the file and, where there is one, the
field (``meta.records_in``, ``kind_version``, ``aerie.schema_version``):

- manifests must be well-formed, of the expected ``kind`` and of a ``kind_version`` this
  release reads; meta values are type-checked (``bool`` is never an integer) and bounded;
- file entries must be plain names, each listed once;
- Parquet parts that claim a kind or schema version (``aerie.kind``,
  ``aerie.schema_version`` in their schema metadata) must claim this release's; parts that
  claim nothing are foreign files, read and validated record by record.
"""

from __future__ import annotations

import re

import pyarrow as pa

from pipeline.contracts import FileEntry, Manifest
from pipeline.manifest import ManifestError, manifest_key, meta_value, read_manifest
from pipeline.parquet import ParquetFileError, read_table
from pipeline.snapshot.render import int_text, quote
from pipeline.snapshot.schema import (
    ADDED_FIELDS,
    INT64_MAX,
    READABLE_SCHEMA_VERSIONS,
    ROLLOUT_SCHEMA,
)
from pipeline.snapshot.sieve import SnapshotError
from pipeline.storage import Storage
from pipeline.verified import IntegrityError

PART_KIND = ROLLOUT_SCHEMA.metadata[b"aerie.kind"]
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_MAX_PROBLEMS = 5  # listed in one error message; the rest are counted


def checked_manifest(storage: Storage, prefix: str, kind: str,
                     kind_versions: tuple[int, ...]) -> Manifest | None:
    """The manifest at ``prefix`` (None when uncommitted), of ``kind`` and a readable
    ``kind_version``, its file entries plain names listed once."""
    try:
        manifest = read_manifest(storage, prefix, kind=kind, kind_versions=kind_versions)
    except ManifestError as e:
        raise SnapshotError(str(e), url=e.url, field=e.field) from e
    if manifest is None:
        return None
    url = storage.url(manifest_key(prefix))
    seen: set[str] = set()
    for i, entry in enumerate(manifest.files):
        if not _PLAIN_NAME.fullmatch(entry.path) or entry.path == "_manifest.json":
            raise SnapshotError(f"{url}: files[{i}].path: {quote(entry.path, 80)!r} is not a "
                                "plain file name", url=url, field=f"files[{i}].path")
        if entry.path in seen:
            raise SnapshotError(f"{url}: files[{i}].path: {entry.path} is listed twice",
                                url=url, field=f"files[{i}].path")
        seen.add(entry.path)
    return manifest


def require_file(storage: Storage, prefix: str, manifest: Manifest, path: str) -> None:
    if path not in {f.path for f in manifest.files}:
        url = storage.url(manifest_key(prefix))
        raise SnapshotError(f"{url}: files: {path} is not listed", url=url, field="files")


def meta_int(storage: Storage, prefix: str, manifest: Manifest, name: str, *,
             minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """``meta.<name>``: an integer (never a bool) in [minimum, maximum]."""
    value = _meta(storage, prefix, manifest, name, int)
    if not minimum <= value <= maximum:
        url = storage.url(manifest_key(prefix))
        raise SnapshotError(f"{url}: meta.{name}: {int_text(value)} is outside "
                            f"[{minimum}, {maximum}]", url=url, field=f"meta.{name}")
    return value


def meta_str(storage: Storage, prefix: str, manifest: Manifest, name: str) -> str:
    """``meta.<name>``: non-empty text."""
    value = _meta(storage, prefix, manifest, name, str)
    if not value:
        url = storage.url(manifest_key(prefix))
        raise SnapshotError(f"{url}: meta.{name}: empty", url=url, field=f"meta.{name}")
    return value


def _meta(storage: Storage, prefix: str, manifest: Manifest, name: str, expected: type):
    try:
        return meta_value(storage, prefix, manifest, name, expected)
    except ManifestError as e:
        raise SnapshotError(str(e), url=e.url, field=e.field) from e


def refuse_problems(problems: list[str]) -> None:
    """Raise for the problems :func:`~pipeline.manifest.verify_manifest` found, if any."""
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        listed = "; ".join(problems[:_MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
        raise SnapshotError(f"corrupt snapshot: {listed}")


def read_part(storage: Storage, prefix: str, entry: FileEntry, *, claimed: bool,
              schema: pa.Schema | None = None) -> pa.Table:
    """The Parquet file of manifest ``entry``, its bytes checked against the entry; refused
    when it claims another kind or schema version (``claimed``: it must claim ours); cast
    to ``schema`` when given (a field newer than the schema version the file claims,
    :data:`~.schema.ADDED_FIELDS`, is null in its rows; missing from a file that claims a
    version with it, it is a schema mismatch)."""
    key = f"{prefix}/{entry.path}"
    url = storage.url(key)
    try:
        table = read_table(storage, key, entry=entry)
    except FileNotFoundError as e:
        raise SnapshotError(f"{url}: listed in the manifest but missing", url=url) from e
    except (ParquetFileError, IntegrityError) as e:
        raise SnapshotError(str(e), url=url) from e
    _check_claim(url, table.schema.metadata or {}, claimed)
    if schema is None:
        return table
    claimed_version = (table.schema.metadata or {}).get(b"aerie.schema_version", b"")
    for name, since in ADDED_FIELDS.items():
        older = claimed_version.isdigit() and int(claimed_version) < since
        if name in schema.names and name not in table.column_names and older:
            table = table.append_column(schema.field(name),
                                        pa.nulls(table.num_rows, schema.field(name).type))
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowException, KeyError, ValueError, TypeError) as e:
        raise SnapshotError(f"{url}: schema mismatch ({quote(str(e))})", url=url) from e


def _check_claim(url: str, metadata: dict[bytes, bytes], claimed: bool) -> None:
    kind = metadata.get(b"aerie.kind")
    version = metadata.get(b"aerie.schema_version")
    if kind is None and version is None and not claimed:
        return  # a foreign file: its records are validated one by one
    readable = [str(v) for v in READABLE_SCHEMA_VERSIONS]
    if kind != PART_KIND:
        raise SnapshotError(f"{url}: aerie.kind: {_shown(kind)} is not "
                            f"{PART_KIND.decode()!r}", url=url, field="aerie.kind")
    if version is None or version.decode("utf-8", "replace") not in readable:
        raise SnapshotError(f"{url}: aerie.schema_version: {_shown(version)} is not one this "
                            f"release reads ({', '.join(readable)})", url=url,
                            field="aerie.schema_version")


def _shown(value: bytes | None) -> str:
    return "absent" if value is None else repr(quote(value.decode("utf-8", "replace"), 60))
