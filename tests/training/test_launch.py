"""How training processes are started: command lines, the child's environment, failures."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.records import to_json
from pipeline.training.curve import METRICS_MARKER
from pipeline.training.launch import (
    TrainingFailed,
    child_environment,
    launch,
    training_command,
)
from pipeline.training.stage import plan
from pipeline.training.worker import STORAGE_OPTIONS_ENV

from .conftest import FAST, STEP

pytestmark = pytest.mark.integration


def test_one_process_runs_plainly_and_n_go_through_a_launcher(tmp_path):
    spec = tmp_path / "spec.json"
    assert training_command(spec, 1) == [sys.executable, "-m", "pipeline.training.worker",
                                         "--spec", str(spec)]
    torchrun = training_command(spec, 2)
    assert torchrun[1:3] == ["-m", "torch.distributed.run"]
    assert torchrun[torchrun.index("--nproc_per_node") + 1] == "2"
    assert torchrun[-4:] == ["-m", "pipeline.training.worker", "--spec", str(spec)]
    ds = training_command(spec, 4, "deepspeed")
    assert ds[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert ds[ds.index("--num_accelerators") + 1] == "4" and "--module" in ds
    with pytest.raises(ValueError, match="one process"):
        training_command(spec, 2, "python")
    with pytest.raises(ValueError, match="launcher"):
        training_command(spec, 1, "mpirun")


def test_the_child_environment_carries_secrets_outside_the_spec(vocab_storage, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("RANK", "3")  # a parent's own process group must not leak
    spec = plan(vocab_storage, STEP, FAST, tmp_path, "none")
    env = child_environment(spec, {"key": "id", "secret": "s3cr3t"})
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1"
    assert json.loads(env[STORAGE_OPTIONS_ENV]) == {"key": "id", "secret": "s3cr3t"}
    assert "RANK" not in env
    assert "s3cr3t" not in to_json(spec)
    assert str(Path(__file__).resolve().parents[2]) in env["PYTHONPATH"].split(":")


def test_a_failing_run_raises_with_its_log(vocab_storage, tmp_path):
    spec = replace(plan(vocab_storage, STEP, FAST, tmp_path, "none"), vocab_key="0" * 64)
    with pytest.raises(TrainingFailed, match="exited with 1") as info:
        launch(spec)
    assert "vocab/" + "0" * 64 in str(info.value)  # the child's error, from its log
    assert (Path(spec.work_dir) / "train.log").is_file()


def test_each_logged_step_reaches_on_metrics_while_the_run_trains(vocab_storage, tmp_path):
    """The worker's metric lines go to ``on_metrics`` (the MLflow run's live curve), one
    per logged step and equal to the run's own history; never to the log."""
    spec = plan(vocab_storage, STEP, replace(FAST, max_steps=6), tmp_path, "none")
    lines, metrics = [], []
    result = launch(spec, on_line=lines.append, on_metrics=metrics.append)
    assert [m["step"] for m in metrics] == [4, 6]  # log_every 4, and the last step
    by_step = {h["step"]: h for h in result.history}
    for m in metrics:
        assert m == by_step[m["step"]]  # JSON keeps every float digit
    assert lines and not [line for line in lines if METRICS_MARKER in line]


def test_a_hostfile_spreads_the_ranks_over_its_hosts(tmp_path):
    from pipeline.training.launch import Launcher, hostfile_slots

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the GPU hosts\ngpu-1 slots=8\ngpu-2 slots=8  # second\n")
    assert hostfile_slots(hostfile) == {"gpu-1": 8, "gpu-2": 8}
    spec = tmp_path / "spec.json"
    cmd = training_command(spec, 16, Launcher("deepspeed", str(hostfile), "10.0.0.1"))
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--hostfile") + 1] == str(hostfile)
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.1"
    assert "--num_accelerators" not in cmd and cmd[-3:] == ["pipeline.training.worker",
                                                             "--spec", str(spec)]
    assert "--no_ssh_check" not in cmd  # two hosts: DeepSpeed checks ssh reaches them
    assert "--master_port" not in cmd  # rank 0 is on gpu-1: not a port free here
    unset = training_command(spec, 16, Launcher("deepspeed", str(hostfile)))
    assert "--master_addr" not in unset  # DeepSpeed resolves gpu-1 itself
    with pytest.raises(ValueError, match="16 slots but world_size is 8"):
        training_command(spec, 8, Launcher("deepspeed", str(hostfile)))
    with pytest.raises(ValueError, match="needs the deepspeed launcher"):
        training_command(spec, 16, Launcher("torchrun", str(hostfile)))
    hostfile.write_text("gpu-1 slots=8\ngpu-1 slots=8\n")
    with pytest.raises(ValueError, match="line 2: expected 'host slots=N' once per host"):
        hostfile_slots(hostfile)


def test_a_run_over_a_hostfile_trains_and_keeps_secrets_off_the_remote_env(vocab_storage,
                                                                          tmp_path):
    """One host (localhost) in the hostfile: DeepSpeed's runner takes its local branch of
    the hostfile path (several hosts need ssh + pdsh, which CI lacks); the ranks'
    environment file holds no secret."""
    from pipeline.training.launch import Launcher

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    spec = plan(vocab_storage, STEP, replace(FAST, max_steps=2), tmp_path, "none")
    result = launch(spec, launcher=Launcher("deepspeed", str(hostfile), "127.0.0.1"),
                    storage_options={"key": "id", "secret": "s3cr3t-sentinel"})
    assert result.steps == 2 and result.world_size == 1
    remote = (Path(spec.work_dir) / ".deepspeed_env").read_text()
    assert "DS_ACCELERATOR=cpu" in remote and "PYTHONPATH=" in remote
    assert "s3cr3t-sentinel" not in remote and STORAGE_OPTIONS_ENV not in remote


def test_what_other_hosts_get_survives_deepspeeds_export(tmp_path, monkeypatch):
    """DeepSpeed's pdsh runner exports each ``.deepspeed_env`` line through its own quoting
    (``add_export``) into a remote shell: every value must come out as it went in, and
    nothing of MLflow's (URIs, tokens) may go on that command line."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    from pipeline.training.launch import remote_ready

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-sentinel")
    env = {**child_environment(plan_spec_stub(tmp_path), {"secret": "s3cr3t"},
                               {"dir": str(tmp_path / "cache dir"), "max_bytes": 2**30}),
           "OMP_NUM_THREADS": "4"}
    env = remote_ready(env, tmp_path)
    assert not [k for k in env if k.startswith("MLFLOW")]
    exports = type("Exports", (), {"exports": {}})()
    lines = (tmp_path / ".deepspeed_env").read_text().splitlines()
    for line in lines:
        key, value = line.split("=", 1)
        MultiNodeRunner.add_export(exports, key, value)
    shell = "".join(f"export {k}={v}; " for k, v in exports.exports.items())
    keys = [line.split("=", 1)[0] for line in lines]
    code = f"import os, json; print(json.dumps({{k: os.environ[k] for k in {keys!r}}}))"
    out = subprocess.run(["bash", "-c", f"{shell}{sys.executable} -c {shlex.quote(code)}"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {k: env[k] for k in keys}
    assert {"AERIE_TRAIN_CACHE_DIR", "AERIE_TRAIN_CACHE_MAX_BYTES"} <= set(keys)
    assert "s3cr3t" not in "".join(lines) and "tok-sentinel" not in "".join(lines)


def plan_spec_stub(tmp_path):
    """A spec whose config trains on the CPU (what child_environment looks at)."""
    from types import SimpleNamespace

    return SimpleNamespace(config=SimpleNamespace(device="cpu", threads=0))
