"""The storage layer: one root URL (``file://`` or ``s3://``) behind fsspec.

Invariants every caller relies on:

- **Atomic writes.** A reader sees an object whole or not at all. Locally a write goes to a
  temporary name in the same directory and is renamed into place; on S3 the object is
  uploaded with ``autocommit=False`` and committed only after the last byte was written
  (fsspec's plain ``open("wb")`` would publish a partial object on error).
- **Idempotent names.** Keys are chosen by callers from their inputs; writing the same key
  twice with the same bytes leaves one identical object.
- **Manifests last.** A dataset is a key prefix holding data files plus ``_manifest.json``
  (see :mod:`pipeline.manifest`); the manifest is a single small PUT and is the commit
  point of the dataset.

- **Durable roots only.** ``file://``, ``s3://`` (and the other object stores fsspec knows)
  are accepted; ``memory://``, ``http://``, ``ftp://`` and other non-durable or read-only
  filesystems are refused unless ``allow_ephemeral`` (tests).
- **Nothing from outside.** :meth:`Storage.upload_dir` reads a directory through
  :mod:`pipeline.local_tree`: no link that leaves it is followed, not even one swapped in
  while it is copied, and nothing but regular files is read.
- **Crashes leave no litter for long.** A local temporary file is named after its host and
  process; :meth:`Storage.sweep_temporary` removes those of dead processes under a prefix
  (and, on S3, aborts the multipart uploads left under it) before a dataset is rewritten
  and once it is committed.

- **Bounded waits on S3.** A store that stops answering fails each operation within its
  clients' deadlines (``config_kwargs`` connect and read timeouts and retry attempts, set by
  the storage resource), never hangs: uploads are sent without ``Expect: 100-continue``,
  which aiohttp awaits with no timeout at all, and s3fs's own retry loop, which multiplies
  botocore's, is bounded (:mod:`pipeline.s3_client`).

Keys are ``/``-separated paths relative to the root. This module never reads the
environment: credentials and endpoints arrive as ``storage_options``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from pipeline.local_tree import UnsafeTree, read_tree
from pipeline.owners import older_than, owner_gone, owner_tag
from pipeline.s3_client import S3FS_ATTEMPTS, s3_session

_CHUNK = 1 << 20
DURABLE_PROTOCOLS = frozenset({"file", "local", "s3", "s3a", "gs", "gcs", "az", "abfs",
                               "abfss", "adl"})
_STALE_TMP_S = 24 * 3600  # a temporary file of another host is abandoned after a day


class StorageError(RuntimeError):
    """A storage operation failed for good (bad key, foreign URL, refused root): the message
    names the URL. Not worth retrying."""


class StorageUnavailable(StorageError):
    """The store could not be reached or refused a transient request: worth retrying."""


class StorageFull(StorageUnavailable):
    """The storage root's filesystem (or quota) is full: retried, since retention or an
    operator may free space; the message names the object that did not fit."""


class StorageAccessError(StorageError):
    """The root cannot be used as configured: no retry fixes it. ``cause`` is one of
    ``local`` (a directory that cannot be created or written), ``credentials`` (none found,
    or refused) or ``bucket`` (no such bucket)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class WrittenObject:
    """What was written: the key, its size and the sha256 of its bytes."""

    key: str
    bytes: int
    sha256: str


class _HashingWriter:
    """File-like wrapper that hashes and counts bytes on their way to ``inner``."""

    def __init__(self, inner: BinaryIO):
        self._inner = inner
        self._sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self._sha.update(view)
        self.bytes += view.nbytes
        self._inner.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        self._inner.flush()

    @property
    def closed(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class Storage:
    """A root URL and its fsspec filesystem; all keys are relative to the root."""

    def __init__(self, root_url: str, storage_options: Mapping[str, Any] | None = None, *,
                 cache_dir: str | Path | None = None, cache_max_bytes: int | None = None,
                 allow_ephemeral: bool = False):
        """``cache_dir``/``cache_max_bytes``: where verified local copies of committed
        datasets are kept (:class:`pipeline.verified.DatasetCache`); default a per-user
        directory under the system's temporary directory."""
        if "://" not in root_url:
            root_url = Path(root_url).resolve().as_uri()
        self.root_url = root_url.rstrip("/")
        protocol = self.root_url.split("://", 1)[0].lower()
        if protocol not in DURABLE_PROTOCOLS and not allow_ephemeral:
            raise StorageError(f"{self.root_url}: {protocol}:// is not a durable store; use "
                               f"one of {sorted(DURABLE_PROTOCOLS)}")
        self._options = dict(storage_options or {})
        session = ({"session": s3_session(self._options.get("profile"))}
                   if protocol in ("s3", "s3a") else {})
        self.fs, root_path = fsspec.core.url_to_fs(self.root_url, **self._options, **session)
        if session:
            self.fs.retries = S3FS_ATTEMPTS
        self._root = root_path.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        if self.is_local:
            try:
                os.makedirs(self._root, exist_ok=True)
            except OSError as e:
                raise StorageAccessError(f"cannot create the storage root {self.root_url}: "
                                         f"{e.strerror or e}", "local") from e
        self.cache_dir = Path(cache_dir) if cache_dir else (
            Path(tempfile.gettempdir()) / f"aerie-cache-{os.getuid()}")
        self.cache_max_bytes = cache_max_bytes

    def spec(self) -> dict[str, Any]:
        """What rebuilds this storage in another process (:meth:`from_spec`), as JSON.

        It carries the storage options, credentials included: hand it over a pipe, never
        on a command line, in a log or in metadata."""
        return {"root_url": self.root_url, "storage_options": self.storage_options,
                "cache_dir": str(self.cache_dir), "cache_max_bytes": self.cache_max_bytes}

    @property
    def storage_options(self) -> dict[str, Any]:
        """The options this storage was built from, as JSON (credentials included: hand them
        over a pipe or the environment, never a log); not ``fs.storage_options``, which also
        holds the S3 session object."""
        return dict(self._options)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Storage:
        return cls(spec["root_url"], spec["storage_options"], cache_dir=spec["cache_dir"],
                   cache_max_bytes=spec["cache_max_bytes"])

    def __repr__(self) -> str:
        return f"Storage({self.root_url!r})"

    def check_access(self) -> None:
        """Fail with :class:`StorageAccessError` unless the root can be used: locally a
        writable directory; on S3 a listing of the root's prefix (one request, at most one
        key; credentials scoped to the prefix pass). Credentials that are missing fail
        here, before any work is done."""
        if self.is_local:
            if not os.access(self._root, os.W_OK | os.X_OK):
                raise StorageAccessError(f"the storage root {self.root_url} is not writable",
                                         "local")
            return
        if "s3" not in _protocols(self.fs):
            return
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        bucket, _, key = self._root.partition("/")
        try:
            self.fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1,
                            Prefix=f"{key}/" if key else "")
        except FileNotFoundError as e:
            raise StorageAccessError(f"{self.root_url}: bucket {bucket!r} does not exist",
                                     "bucket") from e
        except PermissionError as e:
            raise StorageAccessError(f"{self.root_url}: the S3 credentials were refused "
                                     f"({e})", "credentials") from e
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise StorageAccessError(f"{self.root_url}: no S3 credentials found ({e})",
                                     "credentials") from e

    # -- naming -----------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The filesystem path of ``key`` (what fsspec calls a path)."""
        key = key.strip("/")
        if not key:
            return self._root
        if any(part in ("", ".", "..") for part in key.split("/")):
            raise StorageError(f"invalid storage key {key!r}")
        return f"{self._root}/{key}"

    def url(self, key: str = "") -> str:
        """The full URL of ``key`` under this root: what logs and the UI show. Records keep
        the key itself (see :meth:`key_of`), so that the state can move."""
        key = key.strip("/")
        return f"{self.root_url}/{key}" if key else self.root_url

    def key_of(self, ref: str) -> str:
        """The key that a recorded reference names.

        Records (manifests, the serving ledger, registry tags) refer to data by its key,
        a reference relative to the storage root, so a copied or moved root (another
        directory, local disk to S3) resolves every reference in its new place. A full URL
        under this root (what Aerie recorded before) is read too; a full URL elsewhere is a
        :class:`StorageError`.
        """
        if "://" not in ref:
            self.path(ref)  # refuses empty, "." and ".." parts
            return ref.strip("/")
        prefix = self.root_url + "/"
        if not ref.startswith(prefix):
            raise StorageError(f"{ref} is not under storage root {self.root_url}: a full URL "
                               f"recorded under another root does not move with the state")
        return ref[len(prefix) :]

    # -- writing ----------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[_HashingWriter]:
        """Atomically write ``key``: the object appears only if the block exits cleanly.

        Yields a binary file-like object; after the block ``writer.bytes`` and
        ``writer.hexdigest()`` describe what was published.
        """
        target = self.path(key)
        if self.is_local:
            with self._local_atomic(target, key) as raw:
                writer = _HashingWriter(raw)
                yield writer
            return
        try:
            raw = self.fs.open(target, "wb", autocommit=False)
        except OSError as e:
            raise StorageUnavailable(f"cannot open {self.url(key)} for writing: {e}") from e
        writer = _HashingWriter(raw)
        try:
            yield writer
            raw.close()  # uploads the buffered tail as a part; nothing is visible yet
            raw.commit()  # completes the multipart upload: the object appears whole
        except BaseException:
            raw.discard()  # aborts the multipart upload: nothing was published
            raw.closed = True  # else fsspec's __del__ would flush and start a new upload
            raise

    @contextlib.contextmanager
    def _local_atomic(self, target: str, key: str) -> Iterator[BinaryIO]:
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.{owner_tag()}"
                                      f".{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(f"cannot write {self.url(key)}: the storage root's "
                                  f"filesystem is full ({e.strerror}); free space (the "
                                  f"refresh policy's retain_steps, AERIE_RETAIN_STEPS, "
                                  f"bounds what shards keep) and run again") from e
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def write_bytes(self, key: str, data: bytes) -> WrittenObject:
        """Write a small object; on S3 a single PUT (visible whole or not at all)."""
        if self.is_local:
            with self.open_write(key) as f:
                f.write(data)
        else:
            self.fs.pipe_file(self.path(key), data)
        return WrittenObject(key, len(data), hashlib.sha256(data).hexdigest())

    def upload_file(self, local_path: str | Path, key: str) -> WrittenObject:
        """Copy a local file to ``key`` atomically, hashing it on the way."""
        with open(local_path, "rb") as src:
            return self._upload_stream(src, key)

    def upload_dir(self, local_dir: str | Path, prefix: str,
                   keep: Callable[[str], bool] | None = None) -> list[WrittenObject]:
        """Copy every file under ``local_dir`` to ``prefix/<relative path>``, sorted; with
        ``keep``, only the files whose relative POSIX path it accepts.

        What it reads and refuses is :func:`pipeline.local_tree.read_tree`'s: nothing
        outside ``local_dir``, checked before anything is copied and again on each opened
        file (a :class:`StorageError` naming the path).
        """
        try:
            return [self._upload_stream(src, f"{prefix}/{rel}")
                    for rel, src in read_tree(Path(local_dir), keep)]
        except UnsafeTree as e:
            raise StorageError(str(e)) from None

    def _upload_stream(self, src: BinaryIO, key: str) -> WrittenObject:
        with self.open_write(key) as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
        return WrittenObject(key, dst.bytes, dst.hexdigest())

    def delete(self, key: str) -> None:
        """Remove one object (e.g. withdraw a manifest before rebuilding its dataset)."""
        self.fs.rm(self.path(key))

    def sweep_temporary(self, prefix: str) -> int:
        """Remove what writers that died left under ``prefix``: local temporary files of
        dead processes (or older than a day, from another host), and on S3 the unfinished
        multipart uploads of keys under it started before now. Returns how many. Call it
        before rewriting a dataset only one writer writes at a time, and once it is
        committed (:func:`pipeline.manifest.write_manifest` does both)."""
        if self.is_local:
            base = Path(self.path(prefix))
            stale = [p for p in base.rglob(".*.tmp") if _abandoned(p)] if base.is_dir() else []
            for p in stale:
                p.unlink(missing_ok=True)
            return len(stale)
        if "s3" in _protocols(self.fs):
            return self._abort_uploads(prefix)
        return 0

    def _abort_uploads(self, prefix: str) -> int:
        bucket, _, key_prefix = self.path(prefix).partition("/")
        started = datetime.now(UTC)
        try:
            found = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                    Prefix=key_prefix.rstrip("/") + "/")
            uploads = [u for u in found.get("Uploads", []) if u["Initiated"] < started]
            for u in uploads:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["Key"],
                                UploadId=u["UploadId"])
        except OSError as e:
            raise StorageUnavailable(f"cannot list or abort the uploads under "
                                     f"{self.url(prefix)}: {e}") from e
        return len(uploads)

    # -- reading ----------------------------------------------------------------------
    def open_read(self, key: str) -> BinaryIO:
        try:
            return self.fs.open(self.path(key), "rb")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self.url(key)} does not exist") from e

    def read_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def sha256(self, key: str) -> tuple[int, str]:
        """Size and sha256 of the stored object, streamed."""
        sha = hashlib.sha256()
        size = 0
        with self.open_read(key) as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
        return size, sha.hexdigest()

    def size(self, key: str) -> int:
        """Bytes of the stored object (metadata only: nothing is read)."""
        return int(self.fs.size(self.path(key)))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def list(self, prefix: str = "") -> list[str]:
        """Keys of all objects under ``prefix`` (recursive, sorted); temp files excluded."""
        base = self.path(prefix)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        root = self._root + "/"
        keys = [p[len(root) :] if p.startswith(root) else p for p in found]
        return sorted(k for k in keys if not posixpath.basename(k).endswith(".tmp"))

    def list_versions(self, prefix: str = "") -> dict[str, str]:
        """:meth:`list` with a version of each object, from the same one listing: its size
        and ETag on S3, its size, inode and mtime locally. An object rewritten with other
        bytes has another version (locally, any rewrite: another file renamed into
        place)."""
        base = self.path(prefix)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        root = self._root + "/"
        out = {}
        for path, info in found.items():
            key = path[len(root) :] if path.startswith(root) else path
            if not posixpath.basename(key).endswith(".tmp"):
                out[key] = _version(info)
        return dict(sorted(out.items()))

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names of the immediate sub-directories of ``prefix``."""
        base = self.path(prefix)
        self.fs.invalidate_cache(base)
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries
                      if e["type"] == "directory")

    def download_dir(self, prefix: str, local_dir: str | Path) -> Path:
        """Copy every object under ``prefix`` into ``local_dir`` (which is returned)."""
        local_dir = Path(local_dir)
        for key in self.list(prefix):
            dest = local_dir / key[len(prefix.strip("/")) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with self.open_read(key) as src, open(dest, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
        return local_dir

    def local_path(self, key: str) -> Path | None:
        """The local filesystem path of ``key`` for ``file://`` roots, else None."""
        return Path(self.path(key)) if self.is_local else None


def _version(info: Mapping[str, Any]) -> str:
    """An object's version from its listing entry (fsspec's ``info``)."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"{info.get('size')}-{str(etag).strip(chr(34))}"
    return f"{info.get('size')}-{info.get('ino')}-{info.get('mtime')}"


def _abandoned(tmp: Path) -> bool:
    """A ``.<name>.<host>-<pid>.<hex>.tmp`` file of a dead process of this host, or any
    temporary file older than a day (another host's, or an older naming)."""
    parts = tmp.name.split(".")
    gone = owner_gone(parts[-3]) if len(parts) >= 4 else None
    return older_than(tmp, _STALE_TMP_S) if gone is None else gone


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
