"""Every committed artifact is verified on read: bytes changed in storage after publication
are a named error in the stage that reads them, never silently used.

One case per artifact kind (policy checkpoint, hidden-state shards, vocab mapping, drafter,
serving record), each through the production read path.
"""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.capture.hf import hf_backend_for_step
from pipeline.capture.window import WindowError, load_target
from pipeline.eagle3.spec import SpecParams
from pipeline.layout import policy_prefix, shards_prefix
from pipeline.manifest import read_manifest
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import ServingTarget, read_serving, resolve_serving
from pipeline.snapshot.policy import publish_policy
from pipeline.storage import Storage
from pipeline.training.stage import resolve_warm_start
from pipeline.verified import IntegrityError
from pipeline.vocab import stage as vocab_stage
from tests.conftest import on_every_storage
from tests.release.helpers import make_drafter_dir, publish_drafter

pytestmark = pytest.mark.integration


@pytest.fixture
def storage(world_root, tmp_path) -> Storage:
    root = tmp_path / "storage"
    shutil.copytree(world_root, root)
    return Storage(root.as_uri(), cache_dir=tmp_path / "cache")


def _flip_last_byte(storage: Storage, key: str) -> None:
    data = bytearray(storage.read_bytes(key))
    data[-1] ^= 0xFF
    storage.write_bytes(key, bytes(data))


def test_policy_weights_replaced_after_publication(storage):
    weights = f"{policy_prefix(3)}/model.safetensors"
    _flip_last_byte(storage, weights)
    with pytest.raises(IntegrityError, match=r"policies/step=000003/model\.safetensors: sha256"):
        load_target(storage, 3)  # training's teacher and embedding
    with pytest.raises(IntegrityError, match=r"step=000003/model\.safetensors"):
        with hf_backend_for_step(storage, 3):  # capture
            pass


def test_a_republished_policy_never_hits_the_old_copy(storage, tmp_path):
    first = load_target(storage, 2)
    local = tmp_path / "policy"
    storage.download_dir(policy_prefix(2), local)
    (local / "_manifest.json").unlink()
    config = json.loads((local / "config.json").read_text())
    config["tie_word_embeddings"] = True  # another layout: the head is the embedding
    (local / "config.json").write_text(json.dumps(config))
    ref = publish_policy(storage, 2, local)
    second = load_target(storage, 2)
    assert second.sha256 == ref.sha256 != first.sha256
    assert second.lm_head is second.embed  # the new config was read, not a cached one


@on_every_storage
def test_shards_damaged_after_commit(storage):
    manifest = read_manifest(storage, shards_prefix(2))
    _flip_last_byte(storage, f"{shards_prefix(2)}/{manifest.files[0].path}")
    with pytest.raises(WindowError, match=rf"shards/step=000002/{manifest.files[0].path}"):
        vocab_stage.run(storage, 3, window=2, draft_vocab_size=64)


def test_vocab_mapping_changed_after_commit(storage):
    result = vocab_stage.run(storage, 3, window=2, draft_vocab_size=64)
    key = storage.key_of(result.uri)
    _flip_last_byte(storage, f"{key}/{vocab_stage.MAPPING_FILE}")
    with pytest.raises(IntegrityError, match=rf"{key}/{vocab_stage.MAPPING_FILE}: sha256"):
        vocab_stage.load_window_vocab(storage, 3)
    with pytest.raises(IntegrityError):  # the cached mapping is not reused either
        vocab_stage.run(storage, 3, window=2, draft_vocab_size=64)


def test_drafter_changed_after_commit(storage, tmp_path):
    uri = publish_drafter(storage, 1, make_drafter_dir(tmp_path / "d"), fingerprint="fp")
    _flip_last_byte(storage, "drafters/step=000001/model.safetensors")
    with pytest.raises(IntegrityError, match=r"drafters/step=000001/model\.safetensors"):
        resolve_warm_start(storage, 2, "previous")  # training's warm start
    ledger = ServingLedger(storage, "m")
    ledger.publish(ServingTarget(uri, "fp", "m", "1"), SpecParams(3, 1, 4), mode="manifest",
                   reason="v1")
    with pytest.raises(IntegrityError, match=r"drafters/step=000001/model\.safetensors"):
        resolve_serving(storage, "m", tmp_path / "serving-cache")  # the rollout launcher


def test_drafter_recommitted_under_the_serving_record(storage, tmp_path):
    """A step re-trained after its drafter was promoted commits other weights at the same
    key, each file matching its new manifest: the launcher refuses to serve them under the
    record that names the promoted fingerprint."""
    uri = publish_drafter(storage, 1, make_drafter_dir(tmp_path / "d"), fingerprint="fp-old")
    ServingLedger(storage, "m").publish(ServingTarget(uri, "fp-old", "m", "1"),
                                        SpecParams(3, 1, 4), mode="manifest", reason="v1")
    publish_drafter(storage, 1, make_drafter_dir(tmp_path / "e", seed=1), fingerprint="fp-new")
    with pytest.raises(IntegrityError, match=r"drafters/step=000001/_manifest\.json: drafter "
                                             r"fingerprint 'fp-new', the serving record names "
                                             r"'fp-old'"):
        resolve_serving(storage, "m", tmp_path / "serving-cache")


def test_serving_record_changed_after_commit(storage, tmp_path):
    uri = publish_drafter(storage, 1, make_drafter_dir(tmp_path / "d"))
    ledger = ServingLedger(storage, "m")
    ledger.publish(ServingTarget(uri, "fp", "m", "1"), SpecParams(3, 1, 4), mode="manifest",
                   reason="v1")
    assert read_serving(storage, "m").target.drafter_uri == uri
    current = json.loads(storage.read_bytes("serving/m/current.json"))
    current["target"]["drafter_uri"] = uri.replace("step=000001", "step=000009")
    storage.write_bytes("serving/m/current.json", json.dumps(current).encode())
    with pytest.raises(IntegrityError, match=r"serving/m/current\.json: differs from .*"
                                             r"manifest-000001\.json"):
        read_serving(storage, "m")
