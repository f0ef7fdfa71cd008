"""The vllm capture backend against a stand-in for vLLM 0.33's hidden-state export
(tests/vllm_contract/capture_server.py, a real process computing with the real model):
Aerie's conventions out of vLLM's, the files cleaned up, and every planted fault named."""

from __future__ import annotations

import fcntl
import json

import pytest
import requests
import torch
from dagster import instance_for_test, materialize

from assets.shards import hidden_state_shards
from pipeline.capture.backends import open_backend
from pipeline.capture.engine_http import EngineConfigError, EngineRequestError
from pipeline.capture.final_norm import load_final_norm
from pipeline.capture.hf import HFCaptureBackend
from pipeline.capture.shards import iter_step, read_shards_manifest
from pipeline.capture.vllm import VLLMCaptureConfig, engine_layer_ids
from pipeline.snapshot.policy import publish_policy
from pipeline.storage import Storage
from resources.capture import CaptureResource, VLLMCapture
from resources.storage import StorageResource
from tests.capture.helpers import CONFIG, STEP, lengths, random_batch, tiny_llama, write_tokenized
from tests.vllm_contract.fixtures import capture_stand_in

pytestmark = pytest.mark.integration

LAYERS, H = 6, 64
AUX = (0, 2, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=LAYERS, hidden=H)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    return path


def vllm_stand_in(policy_dir, files, api_key: str | None = None):
    return capture_stand_in(policy_dir, files, AUX, LAYERS, api_key=api_key)


@pytest.fixture(scope="module")
def server(tmp_path_factory, policy_dir):
    """One stand-in server: (URL, the directory its files land in)."""
    files = tmp_path_factory.mktemp("hidden-states")
    with vllm_stand_in(policy_dir, files) as url:
        yield url, files


@pytest.fixture
def vllm(server):
    url, files = server
    plant(url, None)
    return url, files


def plant(url: str, kind: str | None, count: int = 1) -> None:
    requests.post(f"{url}/_contract/fault", json={"kind": kind, "count": count},
                  timeout=10).raise_for_status()


def leftovers(files) -> list:
    return sorted(files.glob("aerie-*"))


def served(url: str) -> int:
    return requests.get(f"{url}/_contract/stats", timeout=10).json()["served"]


@pytest.fixture(scope="module")
def storage(tmp_path_factory, policy_dir):
    storage = Storage(tmp_path_factory.mktemp("storage").as_uri())
    publish_policy(storage, STEP, policy_dir)
    return storage


def backend(storage, vllm, **kw):
    url, files = vllm
    return VLLMCaptureConfig(urls=[url], files_dir=str(files), hidden_size=H,
                             aux_layer_ids=AUX, num_target_layers=LAYERS,
                             final_norm=load_final_norm(storage, STEP), backoff_s=0.0,
                             **kw).build()


def test_states_are_the_hf_backends_in_aerie_conventions(storage, vllm, model):
    batch = random_batch()
    with open_backend(storage, STEP, "vllm", aux_layer_ids=AUX, options={
            "urls": [vllm[0]], "files_dir": str(vllm[1])}) as ours:
        got = ours.capture(batch)
        record = ours.provenance()
    want = HFCaptureBackend(model, aux_layer_ids=AUX).capture(batch)
    assert len(got) == len(batch)
    for g, w, ids in zip(got, want, batch, strict=True):
        assert g.aux_hidden.shape == (len(ids), 3 * H) and g.final_hidden.shape == (len(ids), H)
        torch.testing.assert_close(g.aux_hidden.float(), w.aux_hidden.float(),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(g.final_hidden.float(), w.final_hidden.float(),
                                   atol=2e-5, rtol=1e-4)  # vLLM's is pre-norm: normed here
    assert leftovers(vllm[1]) == []  # data and lock files removed
    assert record["engine"] == "vllm" and record["engine_version"] == "0.33.0"
    assert record["aux_layer_ids"] == list(AUX)
    assert record["engine_aux_layer_ids"] == [1, 3, 4]  # vLLM's id = input of layer id
    assert record["engine_final_layer_id"] == LAYERS and record["final_capture"] == "post_norm"


@pytest.mark.parametrize("fault", ["missing", "ids", "short", "unlocked"])
def test_a_file_that_is_missing_or_wrong_once_is_asked_for_again(storage, vllm, fault):
    plant(vllm[0], fault)
    before = served(vllm[0])
    with backend(storage, vllm, max_retries=1, file_timeout_s=5.0) as ours:
        (states,) = ours.capture([[5, 6, 7, 8]])
        retries = ours.stats.retries
    assert states.aux_hidden.shape == (4, 3 * H)
    assert retries == (0 if fault == "unlocked" else 1)  # unlocked: read once it parses
    assert served(vllm[0]) - before == 1 + retries
    assert leftovers(vllm[1]) == []


def test_a_file_wrong_every_time_fails_naming_the_sample_and_field(storage, vllm):
    plant(vllm[0], "short", count=2)
    with backend(storage, vllm, max_retries=1) as ours:
        with pytest.raises(EngineRequestError, match=r"samples \[0\] failed after 2 attempt"
                                                     r"(.|\n)*sample 0: aerie-\w+\.safetensors "
                                                     r"hidden_states has 2 rows for 3 tokens"):
            ours.capture([[3, 4, 5]])


@pytest.mark.parametrize("fault, message", [
    ("dtype", "hidden_states is torch.float8_e4m3fn, expected the model dtype"),
    ("layers", r"launch the server with eagle_aux_hidden_state_layer_ids \[1, 3, 4, 6\]"),
    ("default_path", "set allow_custom_save_path"),
    ("no_export", "it exports no hidden states"),
])
def test_a_launch_problem_is_raised_at_once_with_its_fix(storage, vllm, fault, message):
    plant(vllm[0], fault, count=5)
    before = served(vllm[0])
    with backend(storage, vllm, max_retries=3) as ours:
        with pytest.raises(EngineConfigError, match=message):
            ours.capture([[5, 6, 7]])
    assert served(vllm[0]) - before == 1  # not retried


def test_the_servers_may_see_the_files_directory_under_another_path(storage, vllm, tmp_path):
    url, files = vllm
    mount = tmp_path / "mounted"
    mount.symlink_to(files)  # what this process sees of the servers' directory
    with backend(storage, (url, mount), server_files_dir=str(files)) as ours:
        (states,) = ours.capture([[9, 8, 7]])
    assert states.final_hidden.shape == (3, H) and leftovers(files) == []


def test_a_file_given_up_on_is_removed_once_the_server_has_written_it(storage, vllm):
    plant(vllm[0], "slow_write")
    with backend(storage, vllm, max_retries=0, file_timeout_s=0.1) as ours:
        with pytest.raises(EngineRequestError, match="still locked by the server"):
            ours.capture([[5, 6, 7]])
        assert [p.suffix for p in leftovers(vllm[1])] == [".lock"]  # kept: the server writes
    assert leftovers(vllm[1]) == []  # close() waited for the lock, then removed both

    plant(vllm[0], "slow_write")  # a server still writing when close gives up
    with backend(storage, vllm, max_retries=0, file_timeout_s=0.1,
                 cleanup_timeout_s=0.0) as ours:
        with pytest.raises(EngineRequestError):
            ours.capture([[5, 6, 7]])
    (lock,) = leftovers(vllm[1])
    assert lock.suffix == ".lock"  # close returned, leaving what the server still writes
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # blocks until the server has written the file
    for path in leftovers(vllm[1]):
        path.unlink()


def test_a_server_that_does_not_answer_times_out(storage, vllm):
    plant(vllm[0], "timeout")
    with backend(storage, vllm, max_retries=0, timeout_s=0.5) as ours:
        with pytest.raises(EngineRequestError, match="timeout"):
            ours.capture([[5, 6, 7]])


def test_the_final_norm_is_read_from_a_sharded_checkpoint_and_refused_for_other_norms(
        tmp_path):
    model = tiny_llama(layers=LAYERS, hidden=H)
    with torch.no_grad():
        model.model.norm.weight.normal_()  # not the initial ones: the bytes must be read
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    storage = Storage((tmp_path / "s").as_uri())
    publish_policy(storage, STEP, tmp_path / "sharded")
    norm = load_final_norm(storage, STEP)
    x = torch.randn(5, H)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), model.model.norm(x), atol=1e-6, rtol=1e-5)
    half = model.to(torch.bfloat16)
    half.save_pretrained(tmp_path / "bf16")
    publish_policy(storage, STEP + 2, tmp_path / "bf16")
    assert torch.equal(load_final_norm(storage, STEP + 2).weight,
                       half.model.norm.weight.float())  # BF16 bytes read as bf16
    config = json.loads((tmp_path / "sharded" / "config.json").read_text())
    (tmp_path / "sharded" / "config.json").write_text(json.dumps({**config,
                                                                  "model_type": "gemma2"}))
    publish_policy(storage, STEP + 1, tmp_path / "sharded")
    with pytest.raises(ValueError, match="model_type 'gemma2' is not one whose final norm"):
        load_final_norm(storage, STEP + 1)


def test_the_vllm_backend_is_a_capture_resource_setting(tmp_path, policy_dir, vllm):
    url = (tmp_path / "storage").as_uri()
    storage = Storage(url)
    publish_policy(storage, STEP, policy_dir)
    write_tokenized(storage, STEP, lengths(6))
    capture = CaptureResource(backend="vllm", aux_layer_ids=list(AUX), vllm=VLLMCapture(
        urls=[vllm[0]], files_dir=str(vllm[1])))
    config = {"token_budget": CONFIG.token_budget, "heldout_fraction": 0.0}
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", ["step-000003"])
        result = materialize([hidden_state_shards], partition_key="step-000003",
                             instance=instance, resources={"storage": StorageResource(url=url),
                                                           "capture": capture},
                             run_config={"ops": {"hidden_state_shards": {"config": config}}})
    assert result.success
    manifest = read_shards_manifest(storage, STEP)
    assert manifest.meta["backend"] == "vllm" and manifest.meta["samples"] == 6
    assert manifest.meta["provenance"]["engine"] == "vllm"
    assert sum(1 for _ in iter_step(storage, STEP)) == 6
    assert "needs resources.capture.config.vllm.urls" in CaptureResource(
        backend="vllm").problem()


def test_the_guide_command_launches_what_the_backend_reads():
    """The vLLM guide's (docs/vllm.md) ``vllm serve`` flags pass vLLM's checks (as the
    stand-in makes them) and name the layers the guide's capture config asks for."""
    import re
    import shlex
    from pathlib import Path

    from tests.vllm_contract.capture_server import check_launch, parse_args

    guide = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    section = guide.split("# Capturing hidden states with vLLM", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```sh\n(vllm serve .*?)```", section, re.S).group(1)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["vllm", "serve"]
    launch = check_launch(parse_args(argv[2:]))
    aux = json.loads(re.search(r"aux_layer_ids: (\[[0-9, ]+\])", section).group(1))
    layers = int(re.search(r"For a (\d+)-layer target", section).group(1))
    assert launch.layer_ids == engine_layer_ids(aux, layers)
    assert launch.custom_paths and launch.use_lock
    assert re.search(rf"[{{,]\s*files_dir: {re.escape(str(launch.storage))}\b", section)
