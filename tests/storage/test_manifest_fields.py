"""Every field of a manifest, whatever its kind, is checked as it is read: a file entry's
path is a key inside the dataset (never the manifest, never twice), its size and row count
are within 0..2⁶³-1, its sha256 a hex digest, the kind version within range. Each bad value
is a ManifestError naming the manifest's URL and the field."""

from __future__ import annotations

import hashlib
import json

import pytest

from pipeline.manifest import ManifestError, read_manifest
from pipeline.storage import Storage

DIGEST = hashlib.sha256(b"x").hexdigest()
GOOD = {"kind": "test_data", "kind_version": 1, "meta": {}, "schema_version": 1,
        "files": [{"path": "part-00000.parquet", "bytes": 1, "sha256": DIGEST, "rows": 1},
                  {"path": "sub/part-00001.parquet", "bytes": 0, "sha256": DIGEST,
                   "rows": None}]}
BAD = {
    "files[1].path": ["", ".", "..", "../x", "/etc/passwd", "a//b", "a/./b", "a/../b",
                      "a\\b", "_manifest.json", "_rewriting.json", "part-00000.parquet"],
    "files[1].bytes": [-1, -(2**63), 2**63, 10**30],
    "files[1].sha256": ["", "0" * 63, "0" * 65, DIGEST.upper(), "g" * 64, " " + DIGEST[1:]],
    "files[1].rows": [-1, 2**63],
    "kind_version": [-1, 2**63],
}


@pytest.fixture
def storage(tmp_path):
    return Storage((tmp_path / "s").as_uri())


def _write(storage, manifest: dict) -> None:
    storage.write_bytes("d/_manifest.json", json.dumps(manifest).encode())


def test_a_well_formed_manifest_reads(storage):
    _write(storage, GOOD)
    manifest = read_manifest(storage, "d")
    assert [f.path for f in manifest.files] == ["part-00000.parquet", "sub/part-00001.parquet"]


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in BAD.items() for v in vs])
def test_an_out_of_range_or_malformed_field_is_refused_by_name(storage, field, value):
    manifest = json.loads(json.dumps(GOOD))
    if field == "kind_version":
        manifest["kind_version"] = value
    else:
        manifest["files"][1][field.rsplit(".", 1)[1]] = value
    _write(storage, manifest)
    with pytest.raises(ManifestError) as refused:
        read_manifest(storage, "d")
    assert refused.value.field == field
    assert refused.value.url == storage.url("d/_manifest.json")
