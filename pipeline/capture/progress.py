"""Resume markers of a step's extraction: ``_progress/shard-NNNNN.json`` per finished shard.

A marker records a shard's fingerprint (inputs + batch plan + backend + options), size and
sha256, written after the shard is published. A later run, or another process of the same
data-parallel run, keeps a shard only when both its marker and its bytes still match.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from pipeline.capture.shards import WrittenShard
from pipeline.storage import Storage, WrittenObject

log = logging.getLogger(__name__)

PROGRESS_DIR = "_progress"


def marker_key(prefix: str, name: str) -> str:
    return f"{prefix}/{PROGRESS_DIR}/{name}.json"


def write_marker(storage: Storage, prefix: str, name: str, fingerprint: str,
                 written: WrittenShard) -> None:
    storage.write_bytes(marker_key(prefix, name), json.dumps({
        "fingerprint": fingerprint, "bytes": written.obj.bytes, "sha256": written.obj.sha256,
        "rows": written.rows, "tokens": written.tokens, "row_groups": written.row_groups,
    }, sort_keys=True).encode())


def finished_shard(storage: Storage, prefix: str, name: str, fingerprint: str, *,
                   rehash: bool = True) -> WrittenShard | None:
    """The shard a previous run finished for the same fingerprint, if intact: its bytes
    hashed again, or with ``rehash=False`` (a part of this very run wrote it) its size."""
    marker_at, key = marker_key(prefix, name), f"{prefix}/{name}"
    if not storage.exists(marker_at) or not storage.exists(key):
        return None
    try:
        marker: Mapping[str, Any] = json.loads(storage.read_bytes(marker_at))
    except ValueError:
        return None
    if marker.get("fingerprint") != fingerprint:
        return None
    size, digest = (storage.sha256(key) if rehash
                    else (storage.size(key), str(marker.get("sha256"))))
    if (size, digest) != (marker.get("bytes"), marker.get("sha256")):
        log.warning("%s: bytes differ from its progress marker; rewriting it", storage.url(key))
        return None
    return WrittenShard(WrittenObject(key, size, digest), int(marker["rows"]),
                        int(marker["tokens"]), int(marker["row_groups"]))
