"""Writing, reading and verifying dataset manifests.

A dataset is a key prefix: data files plus ``_manifest.json``. The manifest is written last
(a single small PUT) and is the commit point: a prefix without one is unfinished, and its
files may be overwritten by a re-run. Verification re-hashes every file and compares size
and sha256 with the manifest (Parquet page checksums do not cover footers).
"""

from __future__ import annotations

from pipeline.contracts import MANIFEST_NAME, FileEntry, Manifest
from pipeline.records import from_json, to_json
from pipeline.storage import Storage, WrittenObject


def manifest_key(prefix: str) -> str:
    return f"{prefix.strip('/')}/{MANIFEST_NAME}"


def entry_for(prefix: str, written: WrittenObject, rows: int | None = None) -> FileEntry:
    """The manifest entry of an object written under ``prefix``."""
    base = prefix.strip("/") + "/"
    if not written.key.startswith(base):
        raise ValueError(f"{written.key} is not under {prefix}")
    return FileEntry(path=written.key[len(base) :], bytes=written.bytes,
                     sha256=written.sha256, rows=rows)


def write_manifest(storage: Storage, prefix: str, manifest: Manifest) -> str:
    """Commit the dataset at ``prefix``; returns the manifest's URL."""
    key = manifest_key(prefix)
    storage.write_bytes(key, to_json(manifest).encode())
    return storage.url(key)


def read_manifest(storage: Storage, prefix: str) -> Manifest | None:
    """The committed manifest at ``prefix``, or None when the dataset is unfinished."""
    key = manifest_key(prefix)
    if not storage.exists(key):
        return None
    try:
        return from_json(Manifest, storage.read_bytes(key).decode())
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{storage.url(key)}: unreadable manifest ({e})") from e


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
