"""Start the vLLM stand-in on loopback for a test and stop it by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import requests

from tests.conftest import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def vllm_server(work: Path, args: Sequence[str], *, dev_mode: bool = True,
                tensor_parallel_size: int = 2, extension: bool = True,
                fail_loads: int = 0) -> Iterator[str]:
    """``vllm serve``'s stand-in with ``args`` (e.g. the ``--speculative-config`` pair) and
    Aerie's worker extension; its base URL."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0"}
    cmd = [sys.executable, "-m", "tests.vllm_contract.server", "--port", str(port),
           "--tensor-parallel-size", str(tensor_parallel_size),
           "--fail-loads", str(fail_loads), *args]
    if extension:
        cmd += ["--worker-extension-cls", "pipeline.release.vllm_worker.AerieDraftLoader"]
    log = open(work / f"vllm-{port}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def served(url: str) -> dict:
    """What the stand-in serves now (test-only route)."""
    return requests.get(f"{url}/_contract/drafter", timeout=10).json()
