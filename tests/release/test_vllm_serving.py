"""The vLLM serving modes against a stand-in that honours vLLM 0.33's contract
(``tests/vllm_contract``): the launch flags it parses, the in-place draft reload through
Aerie's worker extension, and the restarts' ``{speculative_config}``."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.release.restart import RestartHook
from pipeline.release.vllm_reload import reload_refusals
from pipeline.serving_now import read_serving, resolve_serving
from resources.serving import ServingResource
from tests.conftest import free_port
from tests.release.helpers import SETTINGS, Drafters, make_drafter_dir
from tests.vllm_contract.fixtures import served, vllm_server

pytestmark = pytest.mark.integration

NAME = "aerie-drafter-demo"


@pytest.fixture
def drafters(tmp_path) -> Drafters:
    d = Drafters(tmp_path, NAME)
    d.manifest.apply(d.targets["1"], reason="first promotion")
    return d


def _launch_args(drafters: Drafters, tmp_path) -> tuple[str, ...]:
    launch = resolve_serving(drafters.storage, NAME, tmp_path / "launcher-cache")
    return launch.args_for("vllm")


def test_the_launch_flags_are_what_vllm_parses_and_a_reload_swaps_every_worker(drafters,
                                                                                tmp_path):
    args = _launch_args(drafters, tmp_path)
    assert args[0] == "--speculative-config"
    assert json.loads(args[1])["num_speculative_tokens"] == SETTINGS.num_steps
    with vllm_server(tmp_path, args) as url:
        assert served(url)["digest"] == drafters.digest("1")
        backend = ServingResource(mode="vllm-reload", server_urls=[url],
                                  cache_dir=str(tmp_path / "cache")).build(drafters.storage,
                                                                           NAME)
        manifest = backend.apply(drafters.targets["2"], reason="promote v2")
        now = served(url)
        assert (now["digest"], now["loads"], now["paused"]) == (drafters.digest("2"), 1, False)
        assert (manifest.mode, manifest.details["servers"]) == ("vllm-reload", "1")

        with pytest.raises(ServingRefused, match="drafter shapes differ.*vllm-restart"):
            backend.apply(drafters.targets["3"], reason="promote v3")
        assert served(url)["loads"] == 1  # refused before any request
        assert read_serving(drafters.storage, NAME).target.registry_version == "2"
        with pytest.raises(ServingRefused, match="cannot turn speculation off"):
            backend.restore(None, reason="undo")


@pytest.mark.parametrize("server, reason", [
    ({"dev_mode": False}, "VLLM_SERVER_DEV_MODE=1"),
    ({"extension": False}, "--worker-extension-cls pipeline.release.vllm_worker"),
])
def test_a_server_that_cannot_reload_is_refused_untouched(drafters, tmp_path, server, reason):
    with vllm_server(tmp_path, _launch_args(drafters, tmp_path), **server) as url:
        backend = ServingResource(mode="vllm-reload", server_urls=[url],
                                  cache_dir=str(tmp_path / "cache")).build(drafters.storage,
                                                                           NAME)
        with pytest.raises(ServingRefused, match=re.escape(reason)):
            backend.apply(drafters.targets["2"], reason="promote v2")
        assert served(url) == {"digest": drafters.digest("1"), "loads": 0, "paused": False,
                               "pauses": 0}
        assert read_serving(drafters.storage, NAME).target.registry_version == "1"


def test_a_server_that_does_not_answer_is_worth_another_try_not_a_refusal(drafters,
                                                                           tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    backend = ServingResource(mode="vllm-reload", server_urls=[url], reload_timeout_s=5,
                              cache_dir=str(tmp_path / "cache")).build(drafters.storage, NAME)
    with pytest.raises(ServingError, match="ConnectionError") as raised:
        backend.apply(drafters.targets["2"], reason="promote v2")
    assert not isinstance(raised.value, ServingRefused)


def test_a_load_failing_part_way_gives_every_reached_server_its_drafter_back(drafters,
                                                                              tmp_path):
    args = _launch_args(drafters, tmp_path)
    with vllm_server(tmp_path, args) as first, \
            vllm_server(tmp_path, args, fail_loads=1) as second:
        backend = ServingResource(mode="vllm-reload", server_urls=[first, second],
                                  cache_dir=str(tmp_path / "cache")).build(drafters.storage,
                                                                           NAME)
        with pytest.raises(ServingError, match="CUDA out of memory"):
            backend.apply(drafters.targets["2"], reason="promote v2")
        for url in (first, second):  # the second's worker 0 had loaded v2: reloaded too
            now = served(url)
            assert (now["digest"], now["paused"]) == (drafters.digest("1"), False), url
        assert read_serving(drafters.storage, NAME).target.registry_version == "1"


def test_a_server_that_cannot_take_its_drafter_back_is_named(drafters, tmp_path):
    args = _launch_args(drafters, tmp_path)
    with vllm_server(tmp_path, args, fail_loads=2) as url:
        backend = ServingResource(mode="vllm-reload", server_urls=[url],
                                  cache_dir=str(tmp_path / "cache")).build(drafters.storage,
                                                                           NAME)
        with pytest.raises(ServingError, match=f"could not be reloaded into {url}.*"
                                               "unrecorded drafter"):
            backend.apply(drafters.targets["2"], reason="promote v2")
        assert served(url)["paused"] is False


def test_vllm_restart_fills_the_speculative_config_and_refuses_a_tree(drafters, tmp_path):
    out = tmp_path / "argv.json"
    argv = [sys.executable, "-c", "import json, sys; json.dump(sys.argv[2:], "
            "open(sys.argv[1], 'w'))", str(out), "--speculative-config", "{speculative_config}"]
    backend = ServingResource(mode="vllm-restart", restart_command=argv,
                              cache_dir=str(tmp_path / "cache")).build(drafters.storage, NAME)
    backend.apply(drafters.targets["2"], reason="promote v2")
    flag, spec = json.loads(out.read_text())
    local = backend._local(drafters.targets["2"])
    assert json.loads(spec) == {"method": "eagle3", "model": str(local),
                                "num_speculative_tokens": 3}
    tree = RestartHook(argv, SpecParams(3, 4, 8), mode="vllm-restart")
    with pytest.raises(ServingRefused, match="chain only"):
        tree.check(local, None)


def test_only_a_drafter_the_running_one_can_be_overwritten_by_is_reloaded(drafters, tmp_path):
    """vLLM reloads weights and ``d2t``, not ``config.json``: another draft vocabulary is
    fine; other shapes, or another RoPE (e.g. after yarn's transformers-only fields were
    dropped), are refused."""
    assert reload_refusals(drafters.dirs["1"], drafters.dirs["2"]) == ()
    assert reload_refusals(drafters.dirs["1"], make_drafter_dir(tmp_path / "vocab", 5)) == ()
    assert "shapes differ" in reload_refusals(drafters.dirs["1"], drafters.dirs["3"])[0]
    rotated = tmp_path / "rotated"
    shutil.copytree(drafters.dirs["2"], rotated)
    config = json.loads((rotated / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}
    config["rope_parameters"] = {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    (rotated / "config.json").write_text(json.dumps(config))
    reasons = reload_refusals(drafters.dirs["1"], rotated)
    assert len(reasons) == 1 and "RoPE" in reasons[0]  # shapes and aux layer ids match
