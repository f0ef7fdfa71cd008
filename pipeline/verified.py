"""Reading committed datasets: every byte checked against the manifest lineage names.

A stage never reads a committed artifact (policy checkpoint, shards, vocab mapping, drafter,
report) by listing its prefix: it reads the files its manifest lists, and each file's size
and sha256 are checked while the bytes stream by (one pass, no re-read). A mismatch is an
:class:`IntegrityError` naming the file, so a step re-published with another layout, or
weights replaced in storage after publication, can never be loaded under the lineage of
the manifest.

Directories that must be local (an HF checkpoint, a drafter handed to SGLang) come from a
:class:`DatasetCache`: a local directory per dataset *content* (the digest of its manifest's
file list), filled through a temporary name and renamed into place when every file checked
out. A re-published step has another digest, so it can never hit a stale copy; a re-run
after a crash reuses the copy, or sweeps the temporary directory the crash left behind. The
cache keeps at most ``max_bytes``: least recently used entries are removed first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.contracts import FileEntry, Manifest
from pipeline.manifest import (
    DeletedByRetention,
    deleted_note,
    deleted_record,
    read_manifest,
    rewrite_started,
)
from pipeline.owners import older_than, owner_gone, owner_tag
from pipeline.records import to_json
from pipeline.storage import Storage, StorageError

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_DONE = ".done.json"  # <entry>.done.json, written after the entry is in place
_STATS = ".files.json"  # <entry>.files.json: what each file's stat was once verified
_STALE_TMP_S = 24 * 3600  # a temporary directory of another host is stale after a day
DEFAULT_CACHE_BYTES = 64 << 30


class IntegrityError(StorageError):
    """A committed file differs from its manifest (missing, other size, other sha256)."""


def committed(storage: Storage, prefix: str, kind: str | None = None) -> Manifest:
    """The committed manifest at ``prefix`` (of ``kind`` when given), for reading its files:
    FileNotFoundError naming the prefix when there is none, :class:`DeletedByRetention`
    when storage retention deleted its files."""
    manifest = read_manifest(storage, prefix, kind=kind)
    if manifest is None:
        since = rewrite_started(storage, prefix)
        if since is not None:
            raise FileNotFoundError(f"{storage.url(prefix)}: being rewritten (since {since}); "
                                    "its manifest returns when the rewrite commits")
        raise FileNotFoundError(f"{storage.url(prefix)}: no committed {kind or 'dataset'}")
    deleted = deleted_record(manifest)
    if deleted is not None:
        raise DeletedByRetention(deleted_note(storage.url(prefix), deleted))
    return manifest


def cache_of(storage: Storage) -> DatasetCache:
    """The local dataset cache configured for ``storage``."""
    return DatasetCache(storage.cache_dir, storage.cache_max_bytes or DEFAULT_CACHE_BYTES)


def fetch(storage: Storage, prefix: str, *, kind: str | None = None, label: str = "data",
          paths: Iterable[str] | None = None) -> Path:
    """A verified local copy of the committed dataset at ``prefix`` (see
    :meth:`DatasetCache.fetch`)."""
    return cache_of(storage).fetch(storage, prefix, kind=kind, label=label, paths=paths)


def read_verified(storage: Storage, prefix: str, manifest: Manifest, path: str) -> bytes:
    """The bytes of ``prefix/path``, checked against ``manifest``'s entry for ``path``."""
    entry = _entry(storage, prefix, manifest, path)
    key = f"{prefix.strip('/')}/{entry.path}"
    try:
        data = storage.read_bytes(key)
    except FileNotFoundError as e:
        raise IntegrityError(f"{storage.url(key)}: missing, its manifest lists it") from e
    check_bytes(storage.url(key), entry, data)
    return data


def check_bytes(url: str, entry: FileEntry, data: bytes) -> None:
    """:class:`IntegrityError` naming ``url`` unless ``data`` is what ``entry`` describes."""
    _check(url, entry, len(data), hashlib.sha256(data).hexdigest())


def copy_verified(storage: Storage, prefix: str, entry: FileEntry, dest: Path) -> None:
    """Stream ``prefix/entry.path`` to ``dest``, hashing on the way; the copy is checked
    before this returns (``dest`` is then removed on a mismatch).

    One pass: each chunk is hashed on a second thread (hashlib releases the GIL) while the
    next one is read and written, so the copy takes about as long as the slower of the two.
    """
    key = f"{prefix.strip('/')}/{entry.path}"
    sha, size = hashlib.sha256(), 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with storage.open_read(key) as src, open(dest, "wb") as dst, \
                ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
            hashing = None
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                size += len(chunk)
                if hashing is not None:
                    hashing.result()  # chunks enter the hash in order
                hashing = hasher.submit(sha.update, chunk)
            if hashing is not None:
                hashing.result()
        _check(storage.url(key), entry, size, sha.hexdigest())
    except FileNotFoundError as e:
        dest.unlink(missing_ok=True)
        raise IntegrityError(f"{storage.url(key)}: missing, its manifest lists it") from e
    except IntegrityError:
        dest.unlink(missing_ok=True)
        raise


def content_digest(files: Iterable[FileEntry]) -> str:
    """What a cache entry is named by: its files' (path, size, sha256)."""
    sha = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        sha.update(f"{f.path}\0{f.bytes}\0{f.sha256}\n".encode())
    return sha.hexdigest()


@dataclass
class DatasetCache:
    """Verified local copies of committed datasets, named by content, at most ``max_bytes``."""

    root: Path
    max_bytes: int = DEFAULT_CACHE_BYTES

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    def fetch(self, storage: Storage, prefix: str, manifest: Manifest | None = None, *,
              kind: str | None = None, label: str = "data",
              paths: Iterable[str] | None = None) -> Path:
        """A local directory holding the files ``manifest`` (default: the committed one at
        ``prefix``) lists, or only ``paths`` of them, each verified. Reused when cached."""
        manifest = manifest or committed(storage, prefix, kind)
        files = manifest.files if paths is None else tuple(
            _entry(storage, prefix, manifest, p) for p in paths)
        dest = self.root / f"{label}-{content_digest(files)[:32]}"
        if self._intact(dest, files):
            os.utime(_done(dest))  # most recently used
            return dest
        self.root.mkdir(parents=True, exist_ok=True)
        self.sweep()
        self._make_room(sum(f.bytes for f in files), keep=dest)
        tmp = self.root / f".tmp-{owner_tag()}-{uuid.uuid4().hex[:8]}"
        try:
            for entry in files:
                copy_verified(storage, prefix, entry, _inside(tmp, entry.path, storage, prefix))
            if dest.exists():  # a damaged or unfinished entry
                _done(dest).unlink(missing_ok=True)
                shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
            _stats(dest).write_text(json.dumps(_identities(dest, files)))
            _done(dest).write_text(to_json(manifest))  # last: the entry is complete
        except OSError:
            if not self._intact(dest, files):  # not a concurrent twin that finished first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def sweep(self) -> list[Path]:
        """Remove temporary directories left by processes that died (SIGKILL); returns them."""
        removed = []
        for tmp in self.root.glob(".tmp-*"):
            if _abandoned(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
        if removed:
            log.info("cache %s: removed %d abandoned temporary dir(s)", self.root, len(removed))
        return removed

    def entries(self) -> list[Path]:
        return sorted(p for p in self.root.glob("*-*") if p.is_dir() and _done(p).is_file())

    def size(self) -> int:
        """Bytes held under the root, temporary directories included."""
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file()) \
            if self.root.is_dir() else 0

    def _make_room(self, incoming: int, keep: Path) -> None:
        held = self.size()
        for entry in sorted(self.entries(), key=lambda p: _done(p).stat().st_mtime):
            if held + incoming <= self.max_bytes:
                return
            if entry == keep:
                continue
            freed = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            _done(entry).unlink(missing_ok=True)  # first: a half-removed entry is not intact
            shutil.rmtree(entry, ignore_errors=True)
            _stats(entry).unlink(missing_ok=True)
            held -= freed
            log.info("cache %s: evicted %s (%d bytes)", self.root, entry.name, freed)

    @staticmethod
    def _intact(dest: Path, files: Iterable[FileEntry]) -> bool:
        """A complete entry whose files are untouched since they were verified: each one's
        size, inode, modification and change times as recorded when the entry was filled.
        Any write to a file (a same-size edit included, even with its modification time put
        back) changes its change time, so the entry is fetched and verified again."""
        if not _done(dest).is_file():
            return False
        files = list(files)
        try:
            recorded = json.loads(_stats(dest).read_text())
            return recorded == _identities(dest, files)
        except (OSError, ValueError):  # no record (an older cache), a file gone: refetch
            return False


def _identities(dest: Path, files: Iterable[FileEntry]) -> dict[str, list[int]]:
    """Each file's ``[size, inode, mtime_ns, ctime_ns]``, not following links."""
    out = {}
    for entry in files:
        info = os.stat(dest / entry.path, follow_symlinks=False)
        out[entry.path] = [info.st_size, info.st_ino, info.st_mtime_ns, info.st_ctime_ns]
    return out


def _done(entry: Path) -> Path:
    return entry.with_name(entry.name + _DONE)


def _stats(entry: Path) -> Path:
    return entry.with_name(entry.name + _STATS)


def _entry(storage: Storage, prefix: str, manifest: Manifest, path: str) -> FileEntry:
    try:
        return manifest.file(path)
    except KeyError:
        raise IntegrityError(f"{storage.url(prefix)}/{path}: not in the committed "
                             f"{manifest.kind} manifest") from None


def _check(url: str, entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.bytes:
        raise IntegrityError(f"{url}: {size} bytes, its manifest says {entry.bytes}")
    if digest != entry.sha256:
        raise IntegrityError(f"{url}: sha256 {digest[:12]}… differs from its manifest "
                             f"({entry.sha256[:12]}…)")


def _inside(tmp: Path, path: str, storage: Storage, prefix: str) -> Path:
    """``tmp/path``, refusing manifest paths that would leave ``tmp``."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise IntegrityError(f"{storage.url(prefix)}: manifest lists an unsafe path {path!r}")
    return tmp.joinpath(*parts)


def _abandoned(tmp: Path) -> bool:
    """A ``.tmp-<host>-<pid>-<hex>`` directory whose process is gone (this host), or an old
    one (another host sharing the cache, or a name this module did not write)."""
    owner = tmp.name.removeprefix(".tmp-").rpartition("-")[0]
    gone = owner_gone(owner)
    return older_than(tmp, _STALE_TMP_S) if gone is None else gone
