"""The serving resource builds the backend of each mode and rejects bad configuration."""

from __future__ import annotations

import pytest

from pipeline.release.restart import RestartHook
from pipeline.release.vllm_reload import VllmDraftReload
from pipeline.storage import Storage
from resources.serving import ServingResource


@pytest.fixture
def storage(tmp_path):
    return Storage((tmp_path / "s").as_uri())


def test_manifest_is_the_default(storage):
    backend = ServingResource().build(storage, "aerie-drafter-demo")
    assert backend.mode == "manifest" and backend.actuator is None
    assert backend.settings.num_draft_tokens == 4
    assert backend.ledger.prefix == "serving/aerie-drafter-demo"


def test_restart_and_reload_modes(storage, tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_HOME", str(tmp_path / "home"))
    restart = ServingResource(mode="sglang-restart", restart_command=["restart", "{drafter_dir}"],
                              restart_timeout_s=5).build(storage, "m")
    assert isinstance(restart.actuator, RestartHook) and restart.actuator.timeout_s == 5
    assert restart.cache_dir == tmp_path / "home" / "serving-cache"
    reload = ServingResource(mode="vllm-reload", server_urls=["http://a:8000"],
                             reload_timeout_s=7, num_steps=5, topk=4,
                             num_draft_tokens=8).build(storage, "m")
    assert isinstance(reload.actuator, VllmDraftReload)
    assert [c.timeout_s for c in reload.actuator.clients] == [7]
    assert reload.settings.eagle_topk == 4


@pytest.mark.parametrize("config,match", [
    ({"mode": "sglang-resume"}, "mode\n.*Input should be 'manifest', 'sglang-restart'"),
    ({"mode": "sglang-restart"}, "needs restart_command"),
    ({"mode": "sglang-restart", "restart_command": ["x", "{model}"]}, "unknown placeholders"),
    ({"mode": "sglang-hotswap"}, "mode\n.*Input should be 'manifest', 'sglang-restart'"),
    ({"mode": "vllm-reload"}, "needs the vLLM servers' base URLs"),
    ({"num_steps": 3, "topk": 1, "num_draft_tokens": 8}, "num_steps \\+ 1"),
])
def test_bad_configuration_is_rejected(storage, config, match):
    with pytest.raises(ValueError, match=match):
        ServingResource(**config).build(storage, "m")
