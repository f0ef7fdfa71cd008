"""Plain records that cross stage boundaries: manifests and their file entries.

Stdlib only, frozen, JSON-serialisable; they carry metadata (keys, counts, checksums,
versions), never tensors. Every record kind has its own ``SCHEMA_VERSION`` so that a reader
can refuse data written by a newer, incompatible writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "_manifest.json"


@dataclass(frozen=True)
class FileEntry:
    """One data file of a dataset; ``path`` is relative to the dataset prefix."""

    path: str
    bytes: int
    sha256: str
    rows: int | None = None


@dataclass(frozen=True)
class Manifest:
    """The commit record of a dataset, written after all of its files.

    ``kind`` names the dataset type (e.g. ``rollout_snapshot``) and ``kind_version`` the
    schema version of its files; ``meta`` holds kind-specific lineage and counts.
    """

    kind: str
    kind_version: int
    files: tuple[FileEntry, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = MANIFEST_SCHEMA_VERSION

    @property
    def total_rows(self) -> int:
        return sum(f.rows or 0 for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(f"{path} is not in the {self.kind} manifest")
