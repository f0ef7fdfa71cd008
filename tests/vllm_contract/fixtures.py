"""Start the vLLM stand-in on loopback for a test and stop it by PID."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import requests

from tests.conftest import free_port, local_server

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
    with local_server(cmd, work / f"vllm-{port}.log", [port], timeout=120, cwd=ROOT, env=env):
        yield f"http://127.0.0.1:{port}"


def served(url: str) -> dict:
    """What the stand-in serves now (test-only route)."""
    return requests.get(f"{url}/_contract/drafter", timeout=10).json()
