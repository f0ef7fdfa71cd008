"""The sglang-hotswap client: refusals before any request, the sequence, never left paused."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import LedgerBackend, ServingError
from pipeline.release.hotswap import NO_ENCODER, SglangHotswap, hotswap_refusals
from pipeline.release.ledger import ServingLedger
from pipeline.serving_now import ServingTarget
from pipeline.storage import Storage
from tests.release.helpers import make_drafter_dir, publish_drafter

SEQUENCE = ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
            "/end_weight_update", "/flush_cache", "/continue_generation"]
SETTINGS = SpecParams(3, 1, 4)


class FakeSglang:
    """Records weight-update requests; ``fail`` maps a path to an error message."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.fail: dict[str, str] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or "{}")
                fake.calls.append((self.path, body))
                failed = self.path in fake.fail
                data = json.dumps({"success": not failed,
                                   "message": fake.fail.get(self.path, "Success")}).encode()
                self.send_response(400 if failed else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


@pytest.fixture
def sglang():
    fake = FakeSglang()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """same0/same1: same shapes and d2t, other weights; wide: other shapes; vocab: other d2t."""
    root = tmp_path_factory.mktemp("hs")
    same0, same1 = make_drafter_dir(root / "s0", 0), make_drafter_dir(root / "s1", 0)
    t = load_file(str(same1 / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"] + 1.0
    save_file(t, str(same1 / "model.safetensors"))
    wide = make_drafter_dir(root / "wide", 0, hidden_size=64)
    vocab = make_drafter_dir(root / "vocab", 5)
    return {"same0": same0, "same1": same1, "wide": wide, "vocab": vocab}


def fake_encoder(directory):
    """Stands in for an operator-supplied encoder; Aerie itself never builds pickles."""
    return [f"payload-of:{directory.name}"]


def backend_serving(storage, tmp_path, sglang, first_dir, encoder=fake_encoder):
    """A hot-swap backend whose ledger already records ``first_dir`` as served."""
    uri = publish_drafter(storage, 1, first_dir, fingerprint="fp1")
    ledger = ServingLedger(storage, "demo")
    ledger.publish(ServingTarget(uri, "fp1", "aerie-drafter-demo", "1"), SETTINGS,
                   mode="sglang-restart", reason="first deploy")
    return LedgerBackend(ledger, SETTINGS, SglangHotswap([sglang.url], timeout_s=10,
                                                         encoder=encoder),
                         cache_dir=tmp_path / "cache")


def target_for(storage, step, directory):
    return ServingTarget(publish_drafter(storage, step, directory, f"fp{step}"), f"fp{step}",
                         "aerie-drafter-demo", str(step))


def test_refusals_compare_shapes_aux_and_d2t(drafters):
    assert hotswap_refusals(drafters["same0"], drafters["same1"]) == ()
    assert "shapes differ" in hotswap_refusals(drafters["same0"], drafters["wide"])[0]
    assert "d2t" in hotswap_refusals(drafters["same0"], drafters["vocab"])[0]
    d0 = load_file(str(drafters["same0"] / "model.safetensors"))["d2t"]
    d5 = load_file(str(drafters["vocab"] / "model.safetensors"))["d2t"]
    assert not torch.equal(d0, d5)


def test_a_drafter_trained_on_another_rope_is_not_swapped_in(drafters, tmp_path):
    """Hot swap replaces weights, not config.json: the server would keep the serving
    drafter's RoPE (e.g. after yarn's transformers-only fields were dropped)."""
    rotated = tmp_path / "rotated"
    shutil.copytree(drafters["same1"], rotated)
    config = json.loads((rotated / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}
    config["rope_parameters"] = {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    (rotated / "config.json").write_text(json.dumps(config))
    reasons = hotswap_refusals(drafters["same0"], rotated)
    assert len(reasons) == 1 and "RoPE" in reasons[0]  # shapes, ids and d2t all match


@pytest.mark.parametrize("other", ["wide", "vocab"])
def test_incompatible_drafter_is_refused_before_any_request(tmp_path, sglang, drafters, other):
    storage = Storage((tmp_path / "s").as_uri())
    backend = backend_serving(storage, tmp_path, sglang, drafters["same0"])
    before = backend.current()
    with pytest.raises(ServingError, match="hot swap refused.*sglang-restart"):
        backend.apply(target_for(storage, 2, drafters[other]), reason="promote")
    assert sglang.calls == [] and backend.current() == before


def test_without_an_encoder_hotswap_refuses_and_says_why(tmp_path, sglang, drafters):
    storage = Storage((tmp_path / "s").as_uri())
    backend = backend_serving(storage, tmp_path, sglang, drafters["same0"], encoder=None)
    with pytest.raises(ServingError, match="pickle-based MultiprocessingSerializer"):
        backend.apply(target_for(storage, 2, drafters["same1"]), reason="promote")
    assert sglang.calls == [] and "sglang-restart" in NO_ENCODER


def test_the_swap_sequence(tmp_path, sglang, drafters):
    storage = Storage((tmp_path / "s").as_uri())
    backend = backend_serving(storage, tmp_path, sglang, drafters["same0"])
    manifest = backend.apply(target_for(storage, 2, drafters["same1"]), reason="promote v2")
    assert sglang.paths == SEQUENCE
    calls = dict(sglang.calls)
    assert calls["/begin_weight_update"] == {"selector": "draft"}
    update = calls["/update_weights_from_tensor"]
    assert update["selector"] == "draft"
    served = backend._local(backend.current().target)  # the verified copy in the cache
    assert served.parent == tmp_path / "cache"
    assert update["serialized_named_tensors"] == [f"payload-of:{served.name}"]
    assert manifest.mode == "sglang-hotswap" and manifest.details["servers"] == sglang.url


@pytest.mark.parametrize("failing,expected", [
    ("/begin_weight_update", ["/pause_generation", "/begin_weight_update",
                              "/continue_generation"]),
    ("/update_weights_from_tensor", ["/pause_generation", "/begin_weight_update",
                                     "/update_weights_from_tensor", "/end_weight_update",
                                     "/continue_generation"]),
    ("/flush_cache", SEQUENCE),
])
def test_a_failed_step_never_leaves_the_server_paused(tmp_path, sglang, drafters, failing,
                                                      expected):
    storage = Storage((tmp_path / "s").as_uri())
    backend = backend_serving(storage, tmp_path, sglang, drafters["same0"])
    before = backend.current()
    sglang.fail[failing] = "weights mismatch"
    with pytest.raises(ServingError, match="weights mismatch"):
        backend.apply(target_for(storage, 2, drafters["same1"]), reason="promote v2")
    assert sglang.paths == expected
    assert backend.current() == before


def test_hotswap_cannot_deploy_a_first_drafter(tmp_path, sglang, drafters):
    storage = Storage((tmp_path / "s").as_uri())
    backend = LedgerBackend(ServingLedger(storage, "demo"), SETTINGS,
                            SglangHotswap([sglang.url], encoder=fake_encoder),
                            cache_dir=tmp_path / "cache")
    with pytest.raises(ServingError, match="first drafter must be deployed with a restart"):
        backend.apply(target_for(storage, 2, drafters["same1"]), reason="promote")
    assert sglang.calls == []
