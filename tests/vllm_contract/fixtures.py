"""Start the vLLM stand-ins on loopback for a test and stop them by PID: the serving one
(``vllm serve`` with a drafter) and the hidden-state capture one."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import requests

from pipeline.capture.vllm import engine_layer_ids
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


@contextmanager
def capture_stand_in(policy_dir: Path, files: Path, aux_layer_ids: Sequence[int],
                     num_layers: int, api_key: str | None = None) -> Iterator[str]:
    """The hidden-state capture stand-in serving ``policy_dir`` (``num_layers`` layers),
    exporting ``aux_layer_ids`` as files into ``files``; its base URL."""
    port = free_port()
    cmd = capture_command(policy_dir, files, aux_layer_ids, num_layers, port, api_key)
    with local_server(cmd, files.parent / f"vllm-capture-{port}.log", [port], timeout=120):
        yield f"http://127.0.0.1:{port}"


def capture_command(policy_dir: Path, files: Path, aux_layer_ids: Sequence[int],
                    num_layers: int, port: int, api_key: str | None = None) -> list[str]:
    """The command line of the capture stand-in (:func:`capture_stand_in`) on ``port``."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_layer_ids,
                                                                     num_layers)}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(files),
                                        "allow_custom_save_path": True}}
    cmd = [sys.executable, "-m", "tests.vllm_contract.capture_server", str(policy_dir),
           "--port", str(port), "--dtype", "float32", "--speculative-config", json.dumps(spec),
           "--kv-transfer-config", json.dumps(kv), "--no-enable-prefix-caching"]
    return cmd if api_key is None else [*cmd, "--api-key", api_key]
