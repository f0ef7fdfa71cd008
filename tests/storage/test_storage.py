"""The storage contract, run against a local directory and a real S3 API (moto_server)."""

from __future__ import annotations

import hashlib

import pytest

from pipeline.contracts import Manifest
from pipeline.manifest import entry_for, read_manifest, verify_manifest, write_manifest
from pipeline.storage import StorageError
from tests.conftest import on_every_storage

pytestmark = on_every_storage


class Boom(RuntimeError):
    pass


def test_round_trip_and_listing(storage):
    written = storage.write_bytes("ds/a.bin", b"alpha")
    storage.write_bytes("ds/sub/b.bin", b"beta")
    assert written.sha256 == hashlib.sha256(b"alpha").hexdigest()
    assert storage.read_bytes("ds/a.bin") == b"alpha"
    assert storage.list("ds") == ["ds/a.bin", "ds/sub/b.bin"]
    assert storage.list_dirs("ds") == ["sub"]
    assert storage.exists("ds/a.bin") and not storage.exists("ds/missing.bin")
    assert storage.url("ds/a.bin") == f"{storage.root_url}/ds/a.bin"
    assert storage.key_of(storage.url("ds/a.bin")) == "ds/a.bin"
    storage.delete("ds/a.bin")
    assert storage.list("ds") == ["ds/sub/b.bin"]


def test_recorded_references_resolve_to_keys(storage):
    """Records keep keys (they move with the root); full URLs under this root, which older
    releases recorded, still resolve; anything else is named."""
    assert storage.key_of("drafters/step=000001") == "drafters/step=000001"
    assert storage.key_of(storage.url("drafters/step=000001")) == "drafters/step=000001"
    for bad in ("drafters/../policies", "a//b", "./a"):
        with pytest.raises(StorageError, match="invalid storage key"):
            storage.key_of(bad)
    with pytest.raises(StorageError, match="is not under storage root .*does not move"):
        storage.key_of("file:///elsewhere/storage/drafters/step=000001")


@pytest.mark.parametrize("size", [10, 7 * 2**20])  # one PUT-sized and a multipart-sized body
def test_failed_write_publishes_nothing(storage, size):
    payload = b"x" * size
    with pytest.raises(Boom), storage.open_write("ds/partial.bin") as f:
        f.write(payload)
        raise Boom
    assert not storage.exists("ds/partial.bin")
    assert storage.list("ds") == []


def test_failed_overwrite_keeps_the_old_object(storage):
    storage.write_bytes("ds/obj.bin", b"old")
    with pytest.raises(Boom), storage.open_write("ds/obj.bin") as f:
        f.write(b"new-but-broken")
        raise Boom
    assert storage.read_bytes("ds/obj.bin") == b"old"


def test_streamed_write_is_hashed_and_whole(storage):
    chunks = [bytes([i]) * 1_000_000 for i in range(7)]
    with storage.open_write("ds/big.bin") as f:
        for c in chunks:
            f.write(c)
    body = b"".join(chunks)
    assert f.bytes == len(body) and f.hexdigest() == hashlib.sha256(body).hexdigest()
    assert storage.sha256("ds/big.bin") == (len(body), hashlib.sha256(body).hexdigest())


def test_rewrite_with_same_bytes_is_idempotent(storage):
    first = storage.write_bytes("ds/x.bin", b"same")
    second = storage.write_bytes("ds/x.bin", b"same")
    assert first == second and storage.list("ds") == ["ds/x.bin"]


def test_keys_cannot_escape_the_root(storage):
    with pytest.raises(StorageError):
        storage.write_bytes("../escape.bin", b"no")
    with pytest.raises(StorageError):
        storage.path("a//b")


def test_manifest_is_the_commit_point_and_verifies_checksums(storage):
    entries = [entry_for("ds", storage.write_bytes(f"ds/part-{i}.bin", bytes([i]) * 100), rows=i)
               for i in range(3)]
    assert read_manifest(storage, "ds") is None  # files alone do not make a dataset
    manifest = Manifest(kind="test", kind_version=1, files=tuple(entries), meta={"k": 1})
    write_manifest(storage, "ds", manifest)
    back = read_manifest(storage, "ds")
    assert back == manifest and back.total_rows == 3 and back.total_bytes == 300
    assert verify_manifest(storage, "ds", back) == []

    storage.write_bytes("ds/part-1.bin", bytes([9]) * 100)  # same size, other bytes
    storage.write_bytes("ds/part-2.bin", b"short")
    problems = verify_manifest(storage, "ds", back)
    assert len(problems) == 2
    assert "part-1.bin" in problems[0] and "sha256" in problems[0]
    assert "part-2.bin" in problems[1] and "5 bytes" in problems[1]


def test_unreadable_manifest_names_its_url(storage):
    storage.write_bytes("ds/_manifest.json", b"{not json")
    with pytest.raises(ValueError, match="ds/_manifest.json"):
        read_manifest(storage, "ds")


def test_directory_upload_and_download(storage, tmp_path):
    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "nested" / "w.bin").write_bytes(b"\0" * 1000)
    written = storage.upload_dir(src, "ckpt")
    assert [w.key for w in written] == ["ckpt/config.json", "ckpt/nested/w.bin"]
    out = storage.download_dir("ckpt", tmp_path / "dst")
    assert (out / "nested" / "w.bin").read_bytes() == b"\0" * 1000
    assert (out / "config.json").read_text() == "{}"



def test_listed_versions_change_when_an_object_is_rewritten(storage):
    storage.write_bytes("ds/a.json", b'{"v": 1}')
    storage.write_bytes("ds/b.json", b"{}")
    storage.write_bytes("ds/.c.json.tmp", b"partial")
    first = storage.list_versions("ds")
    assert list(first) == storage.list("ds") == ["ds/a.json", "ds/b.json"]
    storage.write_bytes("ds/a.json", b'{"v": 2}')
    second = storage.list_versions("ds")
    assert second["ds/a.json"] != first["ds/a.json"]
    assert second["ds/b.json"] == first["ds/b.json"]
    assert storage.list_versions("none") == {}
