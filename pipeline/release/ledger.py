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
- Writers are expected to hold the promotion lock; the ledger itself does not lock. A
  writer under the cross-host lease passes its fencing token: the manifest keeps it
  (``details.promotion_token``), and a write with a lower token than the current
  manifest's is refused (:class:`StaleFencingToken`), so a promoter that lost its lease
  cannot overwrite a newer holder's update.
- Materialised drafters are verified against the drafter's ``_manifest.json`` (size and
  sha256 per file) before use, and appear in the cache directory by rename only.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from pipeline.algorithms import DEFAULT_ALGORITHM
from pipeline.eagle3.spec import SpecParams
from pipeline.layout import serving_prefix
from pipeline.records import to_json
from pipeline.serving_now import (
    CANARY_SCHEMA_VERSION,
    SERVING_SCHEMA_VERSION,
    Canary,
    ServingManifest,
    ServingTarget,
    current_key,
    entry_key,
    read_serving,
    read_serving_entry,
    serving_args,
    serving_history,
    serving_sequences,
)
from pipeline.storage import Storage

log = logging.getLogger(__name__)


class StaleFencingToken(RuntimeError):
    """A serving write under a lease that another promoter has taken since."""


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
        return read_serving_entry(self.storage, self.name, sequence)

    def sequences(self) -> list[int]:
        return serving_sequences(self.storage, self.name)

    def history(self) -> list[ServingManifest]:
        return serving_history(self.storage, self.name)

    def publish(self, target: ServingTarget | None, settings: SpecParams, *,
                mode: str, reason: str, restored_from: int | None = None,
                details: dict[str, str] | None = None,
                token: int | None = None, algorithm: str = DEFAULT_ALGORITHM,
                canary: Canary | None = None) -> ServingManifest:
        """Record ``target`` as what is served now (``canary`` on part of the servers);
        returns the manifest written. ``token``: the writer's fencing token (refused when
        lower than the current manifest's)."""
        previous = self.current()
        details = dict(details or {})
        if token is not None:
            self.check_token(token, previous)
            details["promotion_token"] = str(token)
        sequences = self.sequences()
        manifest = ServingManifest(
            name=self.name, sequence=(sequences[-1] if sequences else 0) + 1, mode=mode,
            target=target, settings=settings,
            sglang_args=serving_args(settings, algorithm=algorithm) if target is not None
            else (), algorithm=algorithm,
            written_at=datetime.now(UTC).isoformat(timespec="milliseconds"), reason=reason,
            previous_sequence=previous.sequence if previous else None,
            restored_from=restored_from, details=details, canary=canary,
            schema_version=CANARY_SCHEMA_VERSION if canary else SERVING_SCHEMA_VERSION)
        data = to_json(manifest).encode()
        self.storage.write_bytes(self._key(manifest.sequence), data)
        self.storage.write_bytes(current_key(self.name), data)  # the commit point
        log.info("serving %s: manifest %d (%s) -> %s%s", self.name, manifest.sequence, reason,
                 target.drafter_uri if target else "no drafter",
                 f", canary {canary.target.drafter_uri}" if canary else "")
        return manifest

    def check_token(self, token: int, current: ServingManifest | None) -> None:
        """Refuse a writer whose fencing ``token`` is older than ``current``'s."""
        newest = fencing_token(current)
        if newest is not None and newest > token:
            raise StaleFencingToken(
                f"serving {self.name}: manifest {current.sequence} was written under "
                f"promotion token {newest}, newer than this writer's {token}: it lost its "
                f"lease, so it changes nothing")

    def _key(self, sequence: int) -> str:
        return entry_key(self.name, sequence)


def fencing_token(manifest: ServingManifest | None) -> int | None:
    """The promotion token ``manifest`` was written under (None: none, or no manifest)."""
    value = manifest.details.get("promotion_token") if manifest is not None else None
    return int(value) if value is not None else None
