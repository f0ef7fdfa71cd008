"""Starting training processes from a parent that must not hold a process group (Dagster).

``launch(spec)`` writes the spec next to the run, starts ``pipeline.training.worker`` as a child
— plain ``python`` for one process, ``torchrun`` or the ``deepspeed`` launcher for N — streams
its output to ``<work_dir>/train.log`` (forwarding Aerie's own log lines), and returns the
:class:`TrainResult` that rank 0 wrote. The same path is used for 1 and N processes.

Invariants:

- The child gets the parent's environment plus: ``DS_ACCELERATOR=cpu`` on CPU,
  ``OMP_NUM_THREADS`` when threads are fixed, storage options as JSON in
  ``AERIE_TRAIN_STORAGE_OPTIONS`` (never in the spec file).
- Several hosts: the ``deepspeed`` launcher with a :class:`Launcher` ``hostfile`` (lines
  ``host slots=N``; the slots must add up to ``world_size``) starts ranks on each host over
  ssh (pdsh); rank 0 on the hostfile's first host. The remote ranks get the non-secret
  variables through ``.deepspeed_env`` in the work dir; storage credentials never go there
  (each host reads its own, ``AWS_*``), and ``MLFLOW_*`` is dropped (the runner would put it
  on the pdsh command line and in the log).
- A failed child raises :class:`TrainingFailed` with the log's tail. The child leads its own
  session; a parent interrupted while waiting kills that process group (the launcher and its
  ranks) before re-raising, so no orphan keeps training.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pipeline.records import from_json, to_json
from pipeline.training.config import LauncherKind
from pipeline.training.curve import parse_metrics_line
from pipeline.training.distributed import free_port
from pipeline.training.loop import RESULT_NAME
from pipeline.training.spec import TrainResult, TrainSpec
from pipeline.training.worker import CACHE_DIR_ENV, CACHE_MAX_BYTES_ENV, STORAGE_OPTIONS_ENV

log = logging.getLogger(__name__)
LAUNCHERS = get_args(LauncherKind)
SPEC_NAME = "spec.json"
LOG_NAME = "train.log"


class TrainingFailed(RuntimeError):
    """The training process exited with an error; the message holds its last log lines."""


@dataclass(frozen=True)
class Launcher:
    """How the training processes start: ``kind`` (one of :data:`LAUNCHERS`), and for ranks
    on several hosts a DeepSpeed ``hostfile`` with the ``master_addr`` the other hosts reach
    rank 0 at (default: this host's name)."""

    kind: LauncherKind = "auto"
    hostfile: str | None = None
    master_addr: str | None = None


def hostfile_slots(path: str | Path) -> dict[str, int]:
    """The hosts of a DeepSpeed hostfile and their slots (ranks)."""
    hosts: dict[str, int] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if match is None or match.group(1) in hosts:
            raise ValueError(f"hostfile {path}, line {n}: expected 'host slots=N' once per "
                             f"host, got {line!r}")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise ValueError(f"hostfile {path} names no host")
    return hosts


def training_command(spec_path: Path, world_size: int, launcher: str | Launcher = "auto",
                     python: str = sys.executable) -> list[str]:
    """The command line that runs ``spec_path`` with ``world_size`` processes."""
    if isinstance(launcher, Launcher):
        if launcher.hostfile:
            return _hostfile_command(spec_path, world_size, launcher, python)
        launcher = launcher.kind
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if launcher == "auto":
        launcher = "python" if world_size == 1 else "torchrun"
    entry = ["pipeline.training.worker", "--spec", str(spec_path)]
    if launcher == "python":
        if world_size != 1:
            raise ValueError("the plain python launcher runs one process; use torchrun or "
                             "deepspeed for world_size > 1")
        return [python, "-m", *entry]
    port = str(free_port())
    if launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                str(world_size), "--master_addr", "127.0.0.1", "--master_port", port,
                "-m", *entry]
    return [python, "-m", "deepspeed.launcher.runner", "--num_accelerators", str(world_size),
            "--master_addr", "127.0.0.1", "--master_port", port, "--module", *entry]


def _hostfile_command(spec_path: Path, world_size: int, launcher: Launcher,
                      python: str) -> list[str]:
    if launcher.kind != "deepspeed":
        raise ValueError(f"a hostfile needs the deepspeed launcher, not {launcher.kind!r}")
    hosts = hostfile_slots(launcher.hostfile)
    slots = sum(hosts.values())
    if slots != world_size:
        raise ValueError(f"hostfile {launcher.hostfile} has {slots} slots but world_size is "
                         f"{world_size}: set world_size to the hostfile's slots")
    if len(hosts) == 1:  # DeepSpeed launches locally: no ssh to check, a port free here
        where = ["--no_ssh_check", "--master_addr", launcher.master_addr or "127.0.0.1",
                 "--master_port", str(free_port())]
    else:  # rank 0 runs on the hostfile's first host: DeepSpeed finds its address itself
        where = ["--master_addr", launcher.master_addr] if launcher.master_addr else []
    return [python, "-m", "deepspeed.launcher.runner", "--hostfile", str(launcher.hostfile),
            *where, "--module", "pipeline.training.worker", "--spec", str(spec_path)]


# what ranks on other hosts get through .deepspeed_env (never the storage options)
REMOTE_ENV = ("PYTHONPATH", "DS_ACCELERATOR", "OMP_NUM_THREADS", CACHE_DIR_ENV,
              CACHE_MAX_BYTES_ENV)


def remote_ready(env: dict[str, str], work_dir: Path) -> dict[str, str]:
    """``env`` for DeepSpeed's multi-host runner: the ``.deepspeed_env`` it exports to the
    other hosts, written in ``work_dir`` (its working directory); and without ``MLFLOW_*``,
    which the runner exports on the pdsh command line and logs (a tracking URI or token may
    hold a secret; training never talks to MLflow)."""
    (work_dir / ".deepspeed_env").write_text("".join(
        f"{k}={env[k]}\n" for k in REMOTE_ENV if k in env))
    return {k: v for k, v in env.items() if not k.startswith("MLFLOW")}


def child_environment(spec: TrainSpec, storage_options: Mapping[str, Any] | None,
                      cache: Mapping[str, Any] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a parent's own group must not leak into the child's
    if spec.config.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if spec.config.threads:
        env["OMP_NUM_THREADS"] = str(spec.config.threads)
    env[STORAGE_OPTIONS_ENV] = json.dumps(dict(storage_options or {}))
    for var, key in ((CACHE_DIR_ENV, "dir"), (CACHE_MAX_BYTES_ENV, "max_bytes")):
        value = (cache or {}).get(key)
        if value is not None:
            env[var] = str(value)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class TrainingProcess:
    """A started training run; :meth:`wait` streams its log and returns its result."""

    def __init__(self, spec: TrainSpec, *, launcher: str | Launcher = "auto",
                 storage_options: Mapping[str, Any] | None = None,
                 cache: Mapping[str, Any] | None = None,
                 on_line: Callable[[str], None] | None = None,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None):
        self.spec = spec
        self.work_dir = Path(spec.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.work_dir / SPEC_NAME
        spec_path.write_text(to_json(spec))
        (self.work_dir / RESULT_NAME).unlink(missing_ok=True)
        self.command = training_command(spec_path, spec.config.world_size, launcher)
        env = child_environment(spec, storage_options, cache)
        if isinstance(launcher, Launcher) and launcher.hostfile:
            env = remote_ready(env, self.work_dir)
        self.on_line = on_line
        self.on_metrics = on_metrics
        self.log_path = self.work_dir / LOG_NAME
        self.tail: deque[str] = deque(maxlen=60)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env,
                                     cwd=str(self.work_dir), start_new_session=True)
        # Drained from the start, so a full pipe never blocks the child, even if nobody waits.
        self._pump = threading.Thread(target=self._drain, daemon=True)
        self._pump.start()
        log.info("started training (pid %d): %s", self.proc.pid, " ".join(self.command))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                self.tail.append(line.rstrip())
                if " pipeline.training" in line:
                    self._lines.put(line.rstrip())
        self._lines.put(None)

    def wait(self) -> TrainResult:
        """Forward Aerie's log lines (on this thread) until the run ends, each logged step's
        metrics to ``on_metrics``; the run's result."""
        try:
            while (line := self._lines.get()) is not None:
                entry = parse_metrics_line(line)
                if entry is None:
                    (self.on_line or log.info)(line)
                elif self.on_metrics is not None:
                    self.on_metrics(entry)
            code = self.proc.wait()
            self._pump.join()
        except BaseException:
            self.kill()
            raise
        result_path = self.work_dir / RESULT_NAME
        if code != 0 or not result_path.is_file():
            raise TrainingFailed(f"training exited with {code} (log: {self.log_path}):\n"
                                 + "\n".join(self.tail))
        return from_json(TrainResult, result_path.read_text())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the run's process group (the launcher and every rank it started;
        the child leads its own session, so the group is exactly this run)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait()
        self._pump.join(timeout=30)


def launch(spec: TrainSpec, *, launcher: str | Launcher = "auto",
           storage_options: Mapping[str, Any] | None = None,
           cache: Mapping[str, Any] | None = None,
           on_line: Callable[[str], None] | None = None,
           on_metrics: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Run ``spec`` to completion in child process(es); resumes from its work dir.
    ``cache``: ``{"dir", "max_bytes"}`` of the dataset cache the children share."""
    return TrainingProcess(spec, launcher=launcher, storage_options=storage_options,
                           cache=cache, on_line=on_line, on_metrics=on_metrics).wait()
