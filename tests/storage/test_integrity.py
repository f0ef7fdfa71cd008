"""The storage layer's integrity promises: durable roots only, nothing from outside an
uploaded directory, crashed writers swept, and verified, bounded, content-named copies."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.contracts import FileEntry, Manifest
from pipeline.manifest import ManifestError, entry_for, withdraw_manifest, write_manifest
from pipeline.storage import Storage, StorageError
from pipeline.verified import DatasetCache, IntegrityError, committed, fetch, read_verified
from tests.conftest import s3_options


def publish(storage: Storage, prefix: str, files: dict[str, bytes]) -> Manifest:
    written = [storage.write_bytes(f"{prefix}/{name}", data) for name, data in files.items()]
    manifest = Manifest(kind="test_data", kind_version=1,
                        files=tuple(entry_for(prefix, w) for w in written))
    write_manifest(storage, prefix, manifest)
    return manifest


@pytest.mark.parametrize("url", ["memory://x", "http://127.0.0.1:9/x", "ftp://127.0.0.1/x"])
def test_non_durable_roots_are_refused_unless_allowed(url):
    with pytest.raises(StorageError, match="not a durable store"):
        Storage(url)
    if url.startswith("memory"):
        assert Storage(url, allow_ephemeral=True).root_url == url


def test_links_leaving_the_directory_are_refused_before_anything_is_copied(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    src = tmp_path / "policy"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "inside.json").symlink_to(src / "config.json")  # stays inside: copied as a file
    written = storage.upload_dir(src, "p")
    assert sorted(w.key for w in written) == ["p/config.json", "p/inside.json"]

    secret = tmp_path / "hostname"
    secret.write_text("not yours")
    (src / "weights.bin").symlink_to(secret)
    with pytest.raises(StorageError, match=r"weights\.bin: a symbolic link .* outside"):
        storage.upload_dir(src, "q")
    assert storage.list("q") == []
    (src / "weights.bin").unlink()
    (src / "sub").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(StorageError, match="outside"):
        storage.upload_dir(src, "q")
    (src / "sub").unlink()
    os.mkfifo(src / "pipe")
    with pytest.raises(StorageError, match="not a regular file"):
        storage.upload_dir(src, "q")


@pytest.mark.parametrize("swap", ["file", "directory"])
def test_a_file_swapped_for_a_link_after_the_check_is_refused_not_read(tmp_path, monkeypatch,
                                                                     swap):
    """The race: everything checks out, then (between the check and the copy) a file, or
    the directory holding it, becomes a link to an outside file. Reproduced exactly by
    swapping right after the check."""
    import pipeline.local_tree as local_tree

    storage = Storage((tmp_path / "s").as_uri())
    src = tmp_path / "policy"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "weights.bin").write_bytes(b"mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"SECRET")
    checked = local_tree.tree_files

    def check_then_swap(local_dir):
        files = checked(local_dir)
        if swap == "file":
            (src / "sub" / "weights.bin").unlink()
            (src / "sub" / "weights.bin").symlink_to(outside / "weights.bin")
        else:
            shutil.rmtree(src / "sub")
            (src / "sub").symlink_to(outside, target_is_directory=True)
        return files

    monkeypatch.setattr(local_tree, "tree_files", check_then_swap)
    with pytest.raises(StorageError, match=r"sub/weights\.bin: changed while it was published"):
        storage.upload_dir(src, "p")
    assert not any(storage.read_bytes(k) == b"SECRET" for k in storage.list("p"))


def test_hard_links_count_only_when_every_link_is_inside(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    src = tmp_path / "policy"
    src.mkdir()
    (src / "a.bin").write_bytes(b"shared")
    os.link(src / "a.bin", src / "b.bin")  # both links inside: published as two files
    assert sorted(w.key for w in storage.upload_dir(src, "p")) == ["p/a.bin", "p/b.bin"]
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    os.link(secret, src / "c.bin")  # the other link is outside
    with pytest.raises(StorageError, match=r"c\.bin: a file with 2 hard links, 1 outside"):
        storage.upload_dir(src, "q")


def test_read_verified_names_the_tampered_file(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    manifest = publish(storage, "d", {"a.bin": b"alpha", "b.bin": b"beta"})
    assert read_verified(storage, "d", manifest, "a.bin") == b"alpha"
    storage.write_bytes("d/a.bin", b"alphA")  # same size, other bytes
    with pytest.raises(IntegrityError, match=r"d/a\.bin: sha256 .* differs from its manifest"):
        read_verified(storage, "d", manifest, "a.bin")
    storage.write_bytes("d/b.bin", b"longer")
    with pytest.raises(IntegrityError, match=r"d/b\.bin: 6 bytes, its manifest says 4"):
        read_verified(storage, "d", manifest, "b.bin")
    with pytest.raises(IntegrityError, match="not in the committed"):
        read_verified(storage, "d", manifest, "c.bin")


def test_a_withdrawn_dataset_tells_readers_it_is_being_rewritten(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    publish(storage, "d", {"a.bin": b"alpha"})
    withdraw_manifest(storage, "d")
    with pytest.raises(FileNotFoundError, match="being rewritten"):
        committed(storage, "d")
    publish(storage, "d", {"a.bin": b"again"})  # the commit clears the marker
    assert committed(storage, "d").files[0].bytes == 5
    assert not storage.exists("d/_rewriting.json")


def test_the_cache_is_named_by_content_verified_and_bounded(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    cache = DatasetCache(tmp_path / "cache", max_bytes=2_500)
    publish(storage, "one", {"w.bin": b"1" * 1000, "config.json": b"{}"})
    first = cache.fetch(storage, "one")
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "w.bin"]  # no extras
    assert cache.fetch(storage, "one") == first  # reused

    publish(storage, "one", {"w.bin": b"2" * 1000, "config.json": b"{}"})  # re-published
    second = cache.fetch(storage, "one")
    assert second != first and (second / "w.bin").read_bytes() == b"2" * 1000

    publish(storage, "two", {"w.bin": b"3" * 1000})
    cache.fetch(storage, "two")
    assert cache.size() <= 2_500 and not first.exists()  # least recently used went first

    storage.write_bytes("two/w.bin", b"4" * 1000)  # replaced after publication
    with pytest.raises(IntegrityError, match=r"two/w\.bin: sha256"):
        DatasetCache(tmp_path / "other").fetch(storage, "two")
    assert list((tmp_path / "other").iterdir()) == []  # nothing half-copied is left


@pytest.mark.parametrize("edit", ["same size", "same size, times put back", "replaced"])
def test_a_cache_copy_that_changed_is_never_loaded(tmp_path, edit):
    """A local copy edited after it was verified (same size, even with its modification time
    put back, or swapped for another file) is fetched and verified again, not reused."""
    storage = Storage((tmp_path / "s").as_uri())
    publish(storage, "d", {"w.bin": b"1" * 1000, "config.json": b"{}"})
    cache = DatasetCache(tmp_path / "cache")
    local = cache.fetch(storage, "d")
    copy = local / "w.bin"
    before = copy.stat()
    if edit == "replaced":
        (local / "other.bin").write_bytes(b"2" * 1000)
        os.replace(local / "other.bin", copy)
    else:
        with open(copy, "r+b") as f:  # in place: same inode, same size
            f.write(b"2" * 1000)
        if edit == "same size, times put back":
            os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert copy.stat().st_size == 1000
    again = cache.fetch(storage, "d")
    assert (again / "w.bin").read_bytes() == b"1" * 1000


def test_unsafe_manifest_paths_never_leave_the_cache(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    bad = Manifest(kind="test_data", kind_version=1,
                   files=(FileEntry("../escape", 1, "0" * 64),))
    write_manifest(storage, "d", bad)
    with pytest.raises(ManifestError, match=r"files\[0\]\.path: '\.\./escape' is not a relative"):
        DatasetCache(tmp_path / "cache").fetch(storage, "d")
    assert not (tmp_path / "escape").exists()


_KILLED_FETCH = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import pipeline.verified as verified
    from pipeline.storage import Storage

    storage = Storage(sys.argv[1])
    real = verified.copy_verified
    def copy_then_die(storage, prefix, entry, dest):
        real(storage, prefix, entry, dest)
        os.kill(os.getpid(), signal.SIGKILL)  # killed half-way, like an OOM kill
    verified.copy_verified = copy_then_die
    verified.DatasetCache(Path(sys.argv[2])).fetch(storage, "policy")
""")
_KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    from pipeline.storage import Storage

    storage = Storage(sys.argv[1])
    with storage.open_write("shards/step=000001/shard-00000.parquet") as f:
        f.write(b"x" * 100_000)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed(script: str, *args: str) -> None:
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=root,
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


@pytest.mark.integration
def test_repeated_sigkill_leaves_no_growth(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    manifest = publish(storage, "policy", {"a.safetensors": os.urandom(200_000),
                                           "b.safetensors": os.urandom(200_000)})
    cache_dir = tmp_path / "cache"
    sizes = []
    for _ in range(4):
        _killed(_KILLED_FETCH, storage.root_url, str(cache_dir))
        sizes.append(DatasetCache(cache_dir).size())
    assert sizes[0] > 0  # a killed fetch does leave a temporary directory behind ...
    local = DatasetCache(cache_dir).fetch(storage, "policy")  # ... which the re-run sweeps
    assert DatasetCache(cache_dir).size() == manifest.total_bytes + sum(
        len((cache_dir / (local.name + suffix)).read_bytes())
        for suffix in (".done.json", ".files.json"))
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".tmp-")] == []

    for _ in range(3):
        _killed(_KILLED_WRITE, storage.root_url)
    left = [p for p in Path(storage.path("shards/step=000001")).iterdir()]
    assert len(left) == 3 and all(p.name.endswith(".tmp") for p in left)
    assert storage.list("shards") == []  # never visible as data
    withdraw_manifest(storage, "shards/step=000001")  # what a re-run does first
    assert list(Path(storage.path("shards/step=000001")).iterdir()) == []


def test_live_writers_temporary_files_are_kept(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    with storage.open_write("d/x.bin") as f:
        f.write(b"in flight")
        assert storage.sweep_temporary("d") == 0  # this process is alive: not swept
    assert storage.read_bytes("d/x.bin") == b"in flight"


@pytest.mark.integration
def test_s3_orphaned_multipart_uploads_of_the_prefix_are_aborted(moto_endpoint):
    opts = s3_options(moto_endpoint)
    Storage("s3://aerie-multipart", opts).fs.mkdir("aerie-multipart")
    storage = Storage("s3://aerie-multipart/root", opts)
    for key in ("root/shards/step=000001/shard-00000.parquet", "root/shards/step=000002/x"):
        storage.fs.call_s3("create_multipart_upload", Bucket="aerie-multipart", Key=key)
    assert storage.sweep_temporary("shards/step=000001") == 1
    left = storage.fs.call_s3("list_multipart_uploads", Bucket="aerie-multipart")
    assert [u["Key"] for u in left.get("Uploads", [])] == ["root/shards/step=000002/x"]


def test_fetch_uses_the_storage_cache_settings(tmp_path):
    storage = Storage((tmp_path / "s").as_uri(), cache_dir=tmp_path / "c", cache_max_bytes=10**6)
    publish(storage, "d", {"a": b"a"})
    assert fetch(storage, "d", label="x").parent == tmp_path / "c"


def test_a_full_disk_is_a_retried_error_naming_the_object_and_leaves_nothing(tmp_path,
                                                                            monkeypatch):
    import errno
    import os

    from assets.retry import is_permanent
    from pipeline.storage import Storage, StorageFull

    storage = Storage(tmp_path.as_uri())
    storage.write_bytes("ds/old.bin", b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageFull, match=r"ds/old\.bin: the storage root's filesystem is "
                                          r"full") as caught:
        storage.write_bytes("ds/old.bin", b"new")
    assert not is_permanent(caught.value)  # space may be freed: Dagster retries
    assert storage.read_bytes("ds/old.bin") == b"old"
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["old.bin"]
