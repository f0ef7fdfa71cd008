"""The drafter back at the RL trainer's weight sync: :class:`DrafterSync` configured from the
environment, reached through verl's own class loader (``checkpoint_manager_class``) and
through slime's post-write hook, handing promoted drafters to a vLLM stand-in
(``tests/vllm_contract``) in place."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import verl.checkpoint_engine.base as verl_base
from ray.exceptions import RayTaskError
from verl.utils.import_utils import load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.replica import RolloutMode

from aerie import cli
from pipeline.adapters import slime_hook
from pipeline.adapters.verl_sync import AerieCheckpointEngineManager
from pipeline.adapters.weight_sync import sync_from_env
from pipeline.release.vllm_worker import METHOD, AerieDraftLoader
from tests.release.helpers import Drafters
from tests.vllm_contract.fixtures import served, vllm_server
from tests.vllm_contract.server import Worker

pytestmark = pytest.mark.integration

NAME = "aerie-drafter-demo"


def _serving_args(engine: str, cache, capsys) -> list[str]:
    """What a launcher gets from ``aerie serving-args ENGINE`` (one flag per line)."""
    capsys.readouterr()
    assert cli.main(["serving-args", engine, "--name", NAME, "--cache", str(cache)]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.fixture
def deployment(tmp_path, monkeypatch, capsys):
    """v1 served, a vLLM stand-in launched on it with ``aerie serving-args vllm``, and the
    ``AERIE_*`` variables of an in-place sync to it."""
    drafters = Drafters(tmp_path, NAME)
    assert drafters.manifest.apply(drafters.targets["1"], reason="first").sequence == 1
    monkeypatch.setenv("AERIE_STORAGE_URL", drafters.storage.url(""))
    with vllm_server(tmp_path, _serving_args("vllm", tmp_path / "launcher", capsys)) as url:
        for key, value in {"AERIE_SERVING_NAME": NAME, "AERIE_SYNC_MODE": "vllm-reload",
                           "AERIE_SYNC_SERVER_URLS": url,
                           "AERIE_SYNC_CACHE_DIR": str(tmp_path / "sync-cache")}.items():
            monkeypatch.setenv(key, value)
        yield drafters, url


def test_serving_args_for_each_launcher(deployment, tmp_path, capsys):
    cache = tmp_path / "launcher"
    drafter = next(cache.iterdir())  # the verified copy the vLLM stand-in runs
    spec = f'{{"method":"eagle3","model":"{drafter}","num_speculative_tokens":3}}'
    assert _serving_args("trl-vllm-serve", cache, capsys) == ["--speculative_config", spec]
    assert _serving_args("nemo-rl", cache, capsys) == [
        "++policy.generation.vllm_kwargs.speculative_config.method=eagle3",
        f"++policy.generation.vllm_kwargs.speculative_config.model={drafter}",
        "++policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens=3"]
    assert _serving_args("verl", cache, capsys) == [
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method=eagle3",
        f"++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.model={drafter}",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config."
        "num_speculative_tokens=3"]
    assert _serving_args("sglang", cache, capsys) == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]


def test_a_promotion_reaches_the_engines_at_the_next_sync_and_a_refusal_never_stops_rl(
        deployment):
    drafters, url = deployment
    sync = sync_from_env()
    assert sync() is None and served(url)["loads"] == 0  # the engines run manifest 1
    drafters.manifest.apply(drafters.targets["2"], reason="promote v2")
    launch = sync()
    assert launch.manifest.sequence == 2 and served(url)["digest"] == drafters.digest("2")
    assert sync() is None and served(url)["loads"] == 1

    drafters.manifest.apply(drafters.targets["3"], reason="promote v3")  # wider: no reload
    assert sync() is None
    assert "drafter shapes differ" in sync.last_error and sync.sequence == 2
    sync.last_error = None
    assert sync() is None and sync.last_error is None  # a refusal is not retried
    assert served(url)["loads"] == 1


def test_serving_args_fails_loudly_where_a_launch_would_silently_lose_the_drafter(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AERIE_STORAGE_URL", (tmp_path / "empty").as_uri())
    assert cli.main(["serving-args", "vllm", "--name", "aerie-drafter-typo"]) == 1
    assert "nothing was ever published" in capsys.readouterr().err


def test_env_errors_name_the_variable(monkeypatch):
    with pytest.raises(ValueError, match="AERIE_STORAGE_URL and AERIE_SERVING_NAME"):
        sync_from_env({})
    env = {"AERIE_STORAGE_URL": "file:///nowhere", "AERIE_SERVING_NAME": NAME}
    with pytest.raises(ValueError, match="AERIE_SYNC_SERVER_URLS"):
        sync_from_env({**env, "AERIE_SYNC_MODE": "vllm-reload"})
    with pytest.raises(ValueError, match="AERIE_SYNC_RESTART_COMMAND must be a JSON list"):
        sync_from_env({**env, "AERIE_SYNC_MODE": "vllm-restart",
                       "AERIE_SYNC_RESTART_COMMAND": '"restart.sh"'})
    with pytest.raises(ValueError, match="unknown placeholders"):
        sync_from_env({**env, "AERIE_SYNC_MODE": "sglang-restart",
                       "AERIE_SYNC_RESTART_COMMAND": '["restart.sh", "{model}"]'})
    with pytest.raises(ValueError, match=r"needs a restart command \(AERIE_SYNC_RESTART"):
        sync_from_env({**env, "AERIE_SYNC_MODE": "sglang-restart"})
    with pytest.raises(ValueError, match="'manifest' is not one of .'fetch', 'sglang-restart'"):
        sync_from_env({**env, "AERIE_SYNC_MODE": "manifest"})  # the sync's name is fetch


class _ActorGroup:
    """verl's actor worker group as the ``naive`` backend uses it."""

    def __init__(self):
        self.calls = []

    def update_weights(self, global_steps, mode):
        self.calls.append((global_steps, mode))
        return []  # the object refs ray.get waits on; no Ray cluster here


def test_verl_loads_the_manager_by_name_and_each_update_syncs_policy_then_drafter(
        deployment, monkeypatch):
    drafters, url = deployment
    monkeypatch.setattr(verl_base.ray, "get", lambda refs: refs)
    cls = load_class_from_fqn("pipeline.adapters.verl_sync.AerieCheckpointEngineManager",
                              "CheckpointEngineManager")
    assert issubclass(cls, verl_base.CheckpointEngineManager)
    actors = _ActorGroup()
    manager = cls(config=CheckpointEngineConfig(backend="naive"), actor_wg=actors,
                  replicas=[])
    assert manager.update_weights(1) == {} and actors.calls == [(1, "naive")]
    drafters.manifest.apply(drafters.targets["2"], reason="promote v2")
    assert manager.update_weights(2) == {}  # as the trainer calls it: no loop running
    assert served(url)["digest"] == drafters.digest("2")
    assert manager.drafter_sync.sequence == 2

    async def from_a_loop():  # verl's auto_await hands an awaiting caller the coroutine
        return await manager.update_weights(3)

    assert asyncio.run(from_a_loop()) == {} and actors.calls[-1] == (3, "naive")


class _ServerActor:
    """A verl vLLM server actor: ``collective_rpc`` runs a method on its engine's workers
    (the stand-in's workers, with Aerie's loader mixed in as vLLM mixes an extension) and
    returns nothing; a worker's exception reaches the caller as a ``RayTaskError``."""

    def __init__(self, drafter_dir, *, extension: bool = True):
        cls = type("Worker", (Worker, AerieDraftLoader), {}) if extension else Worker
        self.workers = [cls(drafter_dir) for _ in range(2)]
        self.fail_loads = 0
        self.loads = 0
        self.collective_rpc = self  # verl calls handle.collective_rpc.remote(...)

    def remote(self, method, kwargs):
        try:
            for rank, w in enumerate(self.workers):
                if method == METHOD and self.fail_loads and rank == 1:
                    self.fail_loads -= 1
                    raise RuntimeError("CUDA out of memory (stand-in)")
                getattr(w, method)(**kwargs)
        except Exception as e:
            raise RayTaskError("collective_rpc", repr(e), e) from e
        self.loads += method == METHOD
        return None

    def digest(self):
        return {w.model_runner.drafter.model.digest() for w in self.workers}


def _verl_manager(drafters, monkeypatch, *actors, mode=RolloutMode.STANDALONE):
    monkeypatch.setenv("AERIE_SYNC_MODE", "verl-replicas")
    monkeypatch.setattr(verl_base.ray, "get", lambda refs, timeout=None: refs)
    replicas = [SimpleNamespace(servers=[a], rollout_mode=mode) for a in actors]
    return AerieCheckpointEngineManager(config=CheckpointEngineConfig(backend="naive"),
                                        actor_wg=_ActorGroup(), replicas=replicas)


def test_verl_replicas_mode_reloads_every_server_actor_and_rolls_back_a_failure(
        deployment, monkeypatch):
    drafters, _ = deployment
    servers = [_ServerActor(drafters.dirs["1"]), _ServerActor(drafters.dirs["1"])]
    manager = _verl_manager(drafters, monkeypatch, *servers)
    drafters.manifest.apply(drafters.targets["2"], reason="promote v2")
    servers[1].fail_loads = 1  # its worker 0 takes v2, worker 1 fails
    assert manager.update_weights(2) == {}  # the RL run goes on
    assert "CUDA out of memory" in manager.drafter_sync.last_error
    assert [s.digest() for s in servers] == [{drafters.digest("1")}] * 2  # rolled back
    manager.update_weights(3)  # tried again at the next sync
    assert [s.digest() for s in servers] == [{drafters.digest("2")}] * 2
    assert manager.drafter_sync.sequence == 2 and manager.drafter_sync.last_error is None
    loads = [s.loads for s in servers]
    manager.update_weights(4)  # standalone servers keep their drafter across syncs
    assert [s.loads for s in servers] == loads


def test_verl_replicas_without_aeries_extension_are_refused_once(deployment, monkeypatch):
    drafters, _ = deployment
    server = _ServerActor(drafters.dirs["1"], extension=False)
    manager = _verl_manager(drafters, monkeypatch, server)
    drafters.manifest.apply(drafters.targets["2"], reason="promote v2")
    manager.update_weights(2)
    assert "worker_extension_cls=pipeline.adapters.verl_vllm" in \
        manager.drafter_sync.last_error
    assert server.digest() == {drafters.digest("1")}


def test_hybrid_replicas_get_the_drafter_back_after_every_sync(deployment, monkeypatch):
    """verl's colocated servers sleep between steps and its sync restores the policy only."""
    drafters, _ = deployment
    server = _ServerActor(drafters.dirs["1"])
    manager = _verl_manager(drafters, monkeypatch, server, mode=RolloutMode.HYBRID)
    for step in (1, 2, 3):
        manager.update_weights(step)
    assert server.loads == 3 and server.digest() == {drafters.digest("1")}


def test_a_drafter_failing_verification_is_refused_once_and_the_run_goes_on(deployment):
    drafters, url = deployment
    sync = sync_from_env()
    drafters.manifest.apply(drafters.targets["2"], reason="promote v2")
    key = f"{drafters.storage.key_of(drafters.targets['2'].drafter_uri)}/model.safetensors"
    drafters.storage.write_bytes(key, b"not the committed bytes")
    assert sync() is None and "IntegrityError" in sync.last_error
    sync.last_error = None
    assert sync() is None and sync.last_error is None  # not fetched again
    assert served(url)["loads"] == 0 and sync.sequence == 1


def test_the_launch_manifest_can_be_named(deployment):
    drafters, url = deployment
    drafters.manifest.apply(drafters.targets["2"], reason="promoted before the hook ran")
    late = sync_from_env({**os.environ, "AERIE_SYNC_LAUNCHED_WITH": "1"})
    assert late.sequence == 1 and late().manifest.sequence == 2
    assert served(url)["digest"] == drafters.digest("2")
    assert sync_from_env({**os.environ, "AERIE_SYNC_LAUNCHED_WITH": ""}).sequence == 2


def test_slimes_post_write_hook_syncs_on_rank_zero(deployment, monkeypatch, tmp_path):
    drafters, url = deployment
    monkeypatch.setattr(slime_hook, "_sync", None)
    slime_hook.post_write(object(), str(tmp_path / "weight_v000001"), [])
    drafters.manifest.apply(drafters.targets["2"], reason="promote v2")
    monkeypatch.setattr(slime_hook, "_rank", lambda: 1)
    slime_hook.post_write(object(), str(tmp_path / "weight_v000002"), [])
    assert served(url)["loads"] == 0  # other ranks leave it to rank 0
    monkeypatch.setattr(slime_hook, "_rank", lambda: 0)
    slime_hook.post_write(object(), str(tmp_path / "weight_v000002"), [])
    assert served(url)["digest"] == drafters.digest("2")


def test_a_canary_reaches_only_its_verl_servers_and_its_promotion_the_rest(
        deployment, monkeypatch):
    drafters, _ = deployment
    servers = [_ServerActor(drafters.dirs["1"]), _ServerActor(drafters.dirs["1"])]
    manager = _verl_manager(drafters, monkeypatch, *servers)
    drafters.manifest.start_canary(drafters.targets["2"], started_at=5,
                                   servers=("replica-1/server-0",), reason="canary v2")
    manager.update_weights(5)
    assert manager.drafter_sync.last_error is None
    assert [s.digest() for s in servers] == [{drafters.digest("1")}, {drafters.digest("2")}]
    drafters.manifest.apply(drafters.targets["2"], reason="canary v2 promoted")
    manager.update_weights(8)
    assert [s.digest() for s in servers] == [{drafters.digest("2")}] * 2
