"""The serving ledger: versioned serving manifests plus an atomically replaced ``current.json``.

Layout in storage, for serving name ``<name>`` (usually the registered model)::

    serving/<name>/manifest-000001.json   immutable, one per change
    serving/<name>/manifest-000002.json
    serving/<name>/current.json           a copy of the newest manifest

Readers (the RL trainer's rollout launcher at weight sync) call :func:`read_serving` or
:func:`resolve_serving`; they read ``current.json`` only.

Invariants:

- Readers never see a partial manifest: every object is written whole by the storage layer
  (local: temp file + rename; S3: one PUT), the versioned manifest first and
  ``current.json`` last. A failure anywhere leaves the previous ``current.json`` in place;
  at worst an orphan ``manifest-N.json`` that no reader follows (the next write takes the
  next free number).
- ``current.json`` holds the whole manifest, not a key: one read gives a consistent record.
- Writers are expected to hold the promotion lock; the ledger itself does not lock.
- Materialised drafters are verified against the drafter's ``_manifest.json`` (size and
  sha256 per file) before use, and appear in the cache directory by rename only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline.contracts import MANIFEST_NAME
from pipeline.evaluation.spec import SpecParams
from pipeline.manifest import read_manifest
from pipeline.serving.contracts import ServingManifest, ServingTarget, serving_args
from pipeline.storage import Storage

log = logging.getLogger(__name__)

CURRENT = "current.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MANIFEST = re.compile(r"^manifest-(\d{6,})\.json$")


def serving_prefix(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"serving name {name!r} must match {_NAME.pattern}")
    return f"serving/{name}"


class ServingLedger:
    """Writes and reads the serving manifests of one serving name."""

    def __init__(self, storage: Storage, name: str):
        self.storage = storage
        self.name = name
        self.prefix = serving_prefix(name)

    def __repr__(self) -> str:
        return f"ServingLedger({self.storage.url(self.prefix)!r})"

    def current(self) -> ServingManifest | None:
        return read_serving(self.storage, self.name)

    def get(self, sequence: int) -> ServingManifest:
        return ServingManifest.from_json(
            self.storage.read_bytes(self._key(sequence)).decode())

    def sequences(self) -> list[int]:
        found = (_MANIFEST.match(k.rsplit("/", 1)[-1]) for k in self.storage.list(self.prefix))
        return sorted(int(m.group(1)) for m in found if m)

    def history(self) -> list[ServingManifest]:
        return [self.get(s) for s in self.sequences()]

    def publish(self, target: ServingTarget | None, settings: SpecParams, *,
                mode: str, reason: str, restored_from: int | None = None,
                details: dict[str, str] | None = None) -> ServingManifest:
        """Record ``target`` as what is served now; returns the manifest written."""
        previous = self.current()
        sequences = self.sequences()
        manifest = ServingManifest(
            name=self.name, sequence=(sequences[-1] if sequences else 0) + 1, mode=mode,
            target=target, settings=settings,
            sglang_args=serving_args(settings) if target is not None else (),
            written_at=datetime.now(UTC).isoformat(timespec="milliseconds"), reason=reason,
            previous_sequence=previous.sequence if previous else None,
            restored_from=restored_from, details=dict(details or {}))
        data = manifest.to_json().encode()
        self.storage.write_bytes(self._key(manifest.sequence), data)
        self.storage.write_bytes(f"{self.prefix}/{CURRENT}", data)  # the commit point
        log.info("serving %s: manifest %d (%s) -> %s", self.name, manifest.sequence, reason,
                 target.drafter_uri if target else "no drafter")
        return manifest

    def _key(self, sequence: int) -> str:
        return f"{self.prefix}/manifest-{sequence:06d}.json"


def read_serving(storage: Storage, name: str) -> ServingManifest | None:
    """The current serving manifest of ``name``, or None if nothing was ever published."""
    key = f"{serving_prefix(name)}/{CURRENT}"
    try:
        data = storage.read_bytes(key)
    except FileNotFoundError:
        return None
    return ServingManifest.from_json(data.decode())


@dataclass(frozen=True)
class ServingLaunch:
    """What a rollout launcher needs: the manifest, the local drafter and SGLang's args."""

    manifest: ServingManifest
    drafter_dir: Path | None
    args: tuple[str, ...]


def resolve_serving(storage: Storage, name: str, cache_dir: str | Path,
                    known_sequence: int | None = None) -> ServingLaunch | None:
    """For the RL trainer at weight sync: the current manifest with its drafter on local
    disk and the SGLang arguments filled in. None when nothing was published, or when the
    current manifest is ``known_sequence`` (nothing changed since the last sync)."""
    manifest = read_serving(storage, name)
    if manifest is None or manifest.sequence == known_sequence:
        return None
    if manifest.target is None:
        return ServingLaunch(manifest, None, ())
    local = materialize_drafter(storage, manifest.target.drafter_uri, cache_dir)
    return ServingLaunch(manifest, local, tuple(manifest.launch_args(str(local))))


def materialize_drafter(storage: Storage, drafter_uri: str, cache_dir: str | Path) -> Path:
    """A local directory holding the drafter at ``drafter_uri`` (under ``storage``'s root).

    Local storage: the stored directory itself. Otherwise a verified copy in ``cache_dir``
    named by the content of the drafter's manifest, downloaded to a temporary name first.
    """
    key = storage.key_of(drafter_uri)
    manifest = read_manifest(storage, key)
    local = storage.local_path(key)
    if local is not None and (local / "config.json").is_file():
        return local
    if manifest is None:
        raise FileNotFoundError(f"{drafter_uri} has no committed drafter manifest")
    digest = hashlib.sha256(manifest.to_json().encode()).hexdigest()[:16]
    dest = Path(cache_dir) / f"drafter-{digest}"
    if (dest / MANIFEST_NAME).is_file():
        return dest
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        storage.download_dir(key, tmp)
        for entry in manifest.files:
            data = (tmp / entry.path).read_bytes()
            if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
                raise ValueError(f"{drafter_uri}/{entry.path} does not match its manifest")
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())  # written last: complete
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / MANIFEST_NAME).is_file():  # not a concurrent twin: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
