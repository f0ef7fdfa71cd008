"""The serving ledger: versioned manifests, an atomic current.json, and the launcher's reader."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import replace

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.records import from_json, to_json
from pipeline.release.backend import LedgerBackend, ServingError
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import ServingManifest, ServingTarget, read_serving, resolve_serving
from pipeline.storage import Storage
from pipeline.verified import IntegrityError
from tests.conftest import on_every_storage
from tests.release.helpers import make_dflash_dir, make_drafter_dir, publish_drafter

SETTINGS = SpecParams(3, 1, 4)


def target(version: str, uri: str = "file:///nowhere") -> ServingTarget:
    return ServingTarget(drafter_uri=uri, fingerprint=f"fp{version}",
                         registry_model="aerie-drafter-demo", registry_version=version)


@on_every_storage
def test_publish_and_read_back(storage: Storage):
    ledger = ServingLedger(storage, "aerie-drafter-demo")
    assert ledger.current() is None and read_serving(storage, "aerie-drafter-demo") is None
    first = ledger.publish(target("1"), SETTINGS, mode="manifest", reason="promote v1")
    second = ledger.publish(target("2"), SETTINGS, mode="manifest", reason="promote v2")
    assert (first.sequence, second.sequence, second.previous_sequence) == (1, 2, 1)
    assert read_serving(storage, "aerie-drafter-demo") == second == ledger.get(2)
    assert [m.target.registry_version for m in ledger.history()] == ["1", "2"]
    assert storage.list("serving/aerie-drafter-demo") == [
        "serving/aerie-drafter-demo/current.json",
        "serving/aerie-drafter-demo/manifest-000001.json",
        "serving/aerie-drafter-demo/manifest-000002.json"]
    assert second.sglang_args == (
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
        "{drafter_dir}", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4")


def test_a_failed_write_leaves_the_old_current_intact(tmp_path, monkeypatch):
    storage = Storage(tmp_path.as_uri())
    ledger = ServingLedger(storage, "m")
    old = ledger.publish(target("1"), SETTINGS, mode="manifest", reason="v1")
    real_open = storage.open_write

    @contextlib.contextmanager
    def dies_halfway(key):
        with real_open(key) as f:
            if key.endswith("current.json"):
                f.write(b'{"schema_version": 1, "name": "m", "seq')  # a partial manifest
                raise OSError("disk full")
            yield f

    monkeypatch.setattr(storage, "open_write", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        ledger.publish(target("2"), SETTINGS, mode="manifest", reason="v2")
    monkeypatch.undo()
    assert read_serving(storage, "m") == old
    assert not [p for p in (tmp_path / "serving" / "m").iterdir() if p.name.endswith(".tmp")]
    # the orphan manifest-000002 is never followed; the next write takes number 3
    assert ledger.publish(target("3"), SETTINGS, mode="manifest", reason="v3").sequence == 3


def test_readers_never_see_a_partial_manifest(tmp_path):
    storage = Storage(tmp_path.as_uri())
    ledger = ServingLedger(storage, "m")
    ledger.publish(target("0"), SETTINGS, mode="manifest", reason="start")
    seen, errors, done = [], [], threading.Event()

    def read():
        while not done.is_set():
            try:
                seen.append(read_serving(storage, "m").sequence)
            except Exception as e:  # noqa: BLE001 - any torn read is the failure we look for
                errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(1, 40):
        ledger.publish(target(str(i)), SETTINGS, mode="manifest", reason=f"v{i}")
    done.set()
    reader.join()
    assert errors == [] and len(seen) > 10
    assert seen == sorted(seen)  # never goes backwards


def test_resolve_downloads_and_verifies_the_drafter(storage: Storage, tmp_path):
    uri = publish_drafter(storage, 7, make_drafter_dir(tmp_path / "d"), fingerprint="fp1")
    ledger = ServingLedger(storage, "m")
    m = ledger.publish(target("1", uri), SETTINGS, mode="manifest", reason="v1")
    launch = resolve_serving(storage, "m", tmp_path / "cache")
    assert (launch.drafter_dir / "model.safetensors").read_bytes() == \
        (tmp_path / "d" / "model.safetensors").read_bytes()
    assert "{drafter_dir}" not in launch.args and str(launch.drafter_dir) in launch.args
    if not storage.is_local:
        assert launch.drafter_dir.parent == tmp_path / "cache"
    assert resolve_serving(storage, "m", tmp_path / "cache", known_sequence=m.sequence) is None


@pytest.mark.integration
def test_a_corrupt_download_is_refused(tmp_path, moto_endpoint):
    from tests.conftest import s3_options

    opts = s3_options(moto_endpoint)
    Storage("s3://serving-corrupt", opts).fs.mkdir("serving-corrupt")
    storage = Storage("s3://serving-corrupt/root", opts)
    uri = publish_drafter(storage, 7, make_drafter_dir(tmp_path / "d"), fingerprint="fp1")
    storage.write_bytes("drafters/step=000007/config.json", b"{}")  # bytes changed after commit
    ledger = ServingLedger(storage, "m")
    ledger.publish(target("1", uri), SETTINGS, mode="manifest", reason="v1")
    with pytest.raises(IntegrityError, match=r"step=000007/config\.json: 2 bytes, its manifest"):
        resolve_serving(storage, "m", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-copied left behind


def test_restore_writes_a_new_manifest_naming_the_old_one(tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    backend = LedgerBackend(ServingLedger(storage, "m"), SETTINGS)
    assert backend.mode == "manifest"
    uri = publish_drafter(storage, 1, make_drafter_dir(tmp_path / "d"))
    first = backend.apply(target("1", uri), reason="v1")
    backend.apply(target("2", uri), reason="v2")
    restored = backend.restore(first, reason="undo")
    assert restored.sequence == 3 and restored.restored_from == 1
    assert restored.target == first.target
    nothing = backend.restore(None, reason="no drafter")
    assert nothing.target is None and nothing.launch_args("/x") == []


def test_a_dflash_drafter_is_recorded_with_its_algorithm_its_blocks_chain_and_its_flags(
        tmp_path):
    storage = Storage((tmp_path / "s").as_uri())
    backend = LedgerBackend(ServingLedger(storage, "m"), SETTINGS)
    eagle = backend.apply(target("1", publish_drafter(storage, 1, make_drafter_dir(
        tmp_path / "e"))), reason="v1")
    assert (eagle.algorithm, eagle.settings) == ("eagle3", SETTINGS)
    uri = publish_drafter(storage, 2, make_dflash_dir(tmp_path / "d", block_size=6), "fp2")
    served = backend.apply(target("2", uri), reason="v2")
    assert served.algorithm == "dflash" and served.settings == SpecParams(5, 1, 6)
    assert served.launch_args("/x") == [
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/x",
        "--speculative-num-draft-tokens", "6"]
    launch = resolve_serving(storage, "m", tmp_path / "cache")
    assert launch.args_for("vllm") == (
        "--speculative-config",
        f'{{"method":"dflash","model":"{launch.drafter_dir}","num_speculative_tokens":5}}')
    v1 = {**json.loads(to_json(eagle)), "schema_version": 1}
    del v1["algorithm"]  # written before manifests named the algorithm: EAGLE-3
    assert from_json(ServingManifest, json.dumps(v1)) == replace(eagle, schema_version=1)


def test_manifest_schema_and_settings_are_validated():
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        SpecParams(3, 1, 8)
    with pytest.raises(ValueError, match="schema_version"):
        from_json(ServingManifest, '{"schema_version": 99}')
    with pytest.raises(ValueError, match="serving name"):
        ServingLedger(Storage("memory://x", allow_ephemeral=True), "../etc")


@pytest.mark.parametrize("uri", ["file:///elsewhere/drafters/step=000001",
                                 "{root}/drafters/step=000009"])
def test_only_committed_drafters_are_served(tmp_path, uri):
    storage = Storage((tmp_path / "s").as_uri())
    backend = LedgerBackend(ServingLedger(storage, "m"), SETTINGS)
    with pytest.raises(ServingError, match="cannot be served|no committed manifest"):
        backend.apply(target("1", uri.format(root=storage.root_url)), reason="v1")
    assert backend.current() is None
