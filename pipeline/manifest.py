"""Writing, reading and verifying dataset manifests.

A dataset is a key prefix: data files plus ``_manifest.json``. The manifest is written last
(a single small PUT) and is the commit point: a prefix without one is unfinished, and its
files may be overwritten by a re-run. Verification re-hashes every file and compares size
and sha256 with the manifest (Parquet page checksums do not cover footers).
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

from pipeline.contracts import MANIFEST_NAME, FileEntry, Manifest
from pipeline.records import RecordError, from_json, to_json
from pipeline.storage import Storage, StorageUnavailable, WrittenObject

log = logging.getLogger(__name__)


class ManifestError(ValueError):
    """A committed manifest is unreadable or lacks what its reader needs; the message names
    the manifest's URL and the field."""

    def __init__(self, url: str, field: str, reason: str):
        super().__init__(f"{url}: {field}: {reason}")
        self.url, self.field, self.reason = url, field, reason


class DeletedByRetention(FileNotFoundError):
    """The dataset's files were deleted by storage retention; its manifest remains, marked
    ``meta.deleted`` (see :mod:`pipeline.retention`)."""


def deleted_record(manifest: Manifest) -> dict[str, Any] | None:
    """``meta.deleted`` of a manifest whose files retention deleted (``{}`` when the marker
    is not an object), else None."""
    value = manifest.meta.get("deleted")
    if value is None:
        return None
    return value if isinstance(value, dict) else {}


def deleted_note(url: str, deleted: dict[str, Any]) -> str:
    """``<url>: files deleted by storage retention at <when> (after the refresh at step N;
    manifest kept)``."""
    return (f"{url}: files deleted by storage retention at {deleted.get('at', 'an unknown time')}"
            f" (after the refresh at step {deleted.get('by_refresh', '?')}; manifest kept)")


REWRITING_NAME = "_rewriting.json"  # present while a committed dataset is being rewritten


def manifest_key(prefix: str) -> str:
    return f"{prefix.strip('/')}/{MANIFEST_NAME}"


def rewriting_key(prefix: str) -> str:
    return f"{prefix.strip('/')}/{REWRITING_NAME}"


def entry_for(prefix: str, written: WrittenObject, rows: int | None = None) -> FileEntry:
    """The manifest entry of an object written under ``prefix``."""
    base = prefix.strip("/") + "/"
    if not written.key.startswith(base):
        raise ValueError(f"{written.key} is not under {prefix}")
    return FileEntry(path=written.key[len(base) :], bytes=written.bytes,
                     sha256=written.sha256, rows=rows)


def write_manifest(storage: Storage, prefix: str, manifest: Manifest) -> str:
    """Commit the dataset at ``prefix``; returns the manifest's URL. What its writer left
    unfinished under ``prefix`` is swept once the manifest is written (every file of the
    dataset is written by then): on S3 an upload that a retried request orphaned (a lost
    answer to CreateMultipartUpload, say) would otherwise stay, billed, until the dataset
    is rewritten. The commit stands if that sweep fails (a store that refuses to list
    uploads, say): a warning names the prefix, and the next rewrite sweeps again."""
    key = manifest_key(prefix)
    storage.write_bytes(key, to_json(manifest).encode())
    if storage.exists(rewriting_key(prefix)):
        storage.delete(rewriting_key(prefix))
    try:
        storage.sweep_temporary(prefix)
    except StorageUnavailable as e:
        log.warning("committed %s, but what its writer left unfinished there was not swept "
                    "(%s): a bucket lifecycle rule that aborts incomplete multipart uploads "
                    "removes it", storage.url(prefix), e)
    return storage.url(key)


def withdraw_manifest(storage: Storage, prefix: str) -> None:
    """Before (re)writing the dataset at ``prefix``: sweep what crashed writers left there,
    mark it as being rewritten and remove its manifest, so that no reader ever takes the
    old manifest for the new files (:func:`rewrite_started` tells them why it is gone)."""
    storage.sweep_temporary(prefix)
    key = manifest_key(prefix)
    if storage.exists(key):
        storage.write_bytes(rewriting_key(prefix), json.dumps(
            {"since": datetime.now(UTC).isoformat(timespec="seconds")}).encode())
        storage.delete(key)


def rewrite_started(storage: Storage, prefix: str) -> str | None:
    """When the unfinished rewrite of ``prefix`` started (ISO time), or None."""
    try:
        data = json.loads(storage.read_bytes(rewriting_key(prefix)))
    except FileNotFoundError:
        return None
    except ValueError:
        return "an unknown time"
    return str(data.get("since")) if isinstance(data, dict) else "an unknown time"


def read_manifest(storage: Storage, prefix: str, *, kind: str | None = None,
                  kind_versions: tuple[int, ...] | None = None) -> Manifest | None:
    """The committed manifest at ``prefix``, or None when the dataset is unfinished.

    A manifest that is not a well-formed :class:`Manifest` (a JSON list, ``null``, a field
    of the wrong type), or whose ``kind``/``kind_version`` is not the one asked for, is a
    :class:`ManifestError` naming the file and the field.
    """
    key = manifest_key(prefix)
    try:
        data = storage.read_bytes(key)
    except FileNotFoundError:
        return None
    url = storage.url(key)
    try:
        manifest = from_json(Manifest, data)
    except RecordError as e:
        field, _, reason = str(e).partition(": ")
        raise ManifestError(url, field if reason else "<manifest>", reason or str(e)) from e
    if kind is not None and manifest.kind != kind:
        raise ManifestError(url, "kind", f"{_short(manifest.kind)} is not {kind!r}")
    if kind_versions is not None and manifest.kind_version not in kind_versions:
        raise ManifestError(url, "kind_version", f"{manifest.kind_version} is not one this "
                                                 f"release reads ({list(kind_versions)})")
    _check_fields(url, manifest)
    return manifest


_INT64 = 2**63 - 1  # what Parquet, Arrow and the stores' sizes hold
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_fields(url: str, manifest: Manifest) -> None:
    """Every field of every manifest, whatever its kind: the ranges and forms the types
    alone do not say. A file entry names one file of the dataset (a relative key, not the
    manifest, named once), its size and row count are 0..2⁶³-1, its sha256 a hex digest."""
    if not 0 <= manifest.kind_version <= _INT64:
        raise ManifestError(url, "kind_version", f"{manifest.kind_version} is out of range")
    seen: set[str] = set()
    for i, entry in enumerate(manifest.files):
        where = f"files[{i}]"
        parts = entry.path.split("/")
        if not entry.path or any(p in ("", ".", "..") for p in parts) or "\\" in entry.path:
            raise ManifestError(url, f"{where}.path", f"{_short(entry.path)} is not a "
                                                      f"relative key inside the dataset")
        if entry.path in (MANIFEST_NAME, REWRITING_NAME):
            raise ManifestError(url, f"{where}.path", f"{entry.path} is not a data file")
        if entry.path in seen:
            raise ManifestError(url, f"{where}.path", f"{_short(entry.path)} is listed twice")
        seen.add(entry.path)
        if not 0 <= entry.bytes <= _INT64:
            raise ManifestError(url, f"{where}.bytes", f"{_short(entry.bytes)} is out of range")
        if not _SHA256.fullmatch(entry.sha256):
            raise ManifestError(url, f"{where}.sha256", f"{_short(entry.sha256)} is not a "
                                                        f"sha256 hex digest")
        if entry.rows is not None and not 0 <= entry.rows <= _INT64:
            raise ManifestError(url, f"{where}.rows", f"{_short(entry.rows)} is out of range")


def meta_value(storage: Storage, prefix: str, manifest: Manifest, name: str,
               expected: type | tuple[type, ...]) -> Any:
    """``manifest.meta[name]``, checked to be of type ``expected`` (``bool`` is never an
    ``int`` here); a :class:`ManifestError` naming the file and the field otherwise."""
    url = storage.url(manifest_key(prefix))
    if name not in manifest.meta:
        raise ManifestError(url, f"meta.{name}", "missing")
    value = manifest.meta[name]
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        wanted = " or ".join(t.__name__ for t in types)
        raise ManifestError(url, f"meta.{name}", f"expected {wanted}, got "
                                                 f"{type(value).__name__} {_short(value)}")
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def verify_manifest(storage: Storage, prefix: str, manifest: Manifest) -> list[str]:
    """Problems found when re-hashing the files of ``manifest``; empty when intact."""
    problems = []
    for entry in manifest.files:
        key = f"{prefix.strip('/')}/{entry.path}"
        if not storage.exists(key):
            problems.append(f"{storage.url(key)}: missing")
            continue
        size, digest = storage.sha256(key)
        if size != entry.bytes:
            problems.append(f"{storage.url(key)}: {size} bytes, manifest says {entry.bytes}")
        elif digest != entry.sha256:
            problems.append(f"{storage.url(key)}: sha256 {digest[:12]}… differs from manifest")
    return problems
