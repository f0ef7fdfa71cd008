"""Fixtures: a tiny random HF Llama on disk and one contract-server process on 127.0.0.1
serving several endpoints (well-configured and misconfigured SGLang stand-ins).

Expose the fixtures in a test module (``contract_deployment = fixtures.contract_deployment``
etc.). The process is started once per session, polled until every port accepts
connections and stopped by PID; ``sglang_servers`` resets every endpoint per test. Other
deployments (e.g. speculative endpoints with their own drafters) use
:func:`contract_process` directly.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import free_port, local_server

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, VOCAB = 8, 64, 128
AUX_IDS = (1, 3, 4)  # EAGLE-3 default for 8 layers: [1, N//2 - 1, N - 4]

# name -> endpoint settings (see server.py); "aux" uses the server's default aux ids.
ENDPOINTS: dict[str, dict[str, Any]] = {
    "final": {"mode": "final"},
    "final_b": {"mode": "final"},
    "aux": {"mode": "aux"},
    "no_hidden": {"mode": "final", "hidden_states": False},
    "radix": {"mode": "final", "radix_cache": True},
    "chunked": {"mode": "final", "chunked_prefill_size": 8},
}


@dataclass(frozen=True)
class ContractServer:
    """One endpoint of the contract server, with its test controls."""

    name: str
    url: str

    def set_faults(self, kind: str, count: int = 1, every: int = 1,
                   delay_s: float = 2.0) -> None:
        r = requests.post(f"{self.url}/_faults", timeout=10,
                          json={"kind": kind, "count": count, "every": every, "delay_s": delay_s})
        r.raise_for_status()

    def reset(self) -> None:
        requests.post(f"{self.url}/_reset", json={}, timeout=10).raise_for_status()

    def stats(self) -> dict[str, int]:
        r = requests.get(f"{self.url}/_stats", timeout=10)
        r.raise_for_status()
        return r.json()


def tiny_llama() -> Any:
    """The random 8-layer, 64-wide ``LlamaForCausalLM`` every contract server serves."""
    from tests.families import tiny_llama as build

    return build(0, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, intermediate=128)


def save_model(model: Any, path: Path) -> Path:
    """``save_pretrained`` to a sibling dir then renamed into ``path``, so that a server
    polling for ``path`` never sees a partial checkpoint."""
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(partial)
    partial.rename(path)
    return path


def save_tiny_llama(path: Path) -> Path:
    """:func:`tiny_llama` saved atomically into ``path``."""
    return save_model(tiny_llama(), path)


@contextlib.contextmanager
def contract_process(work: Path, model_dir: Path, endpoints: Mapping[str, Mapping[str, Any]],
                     prepare: Callable[[], object]) -> Iterator[dict[str, ContractServer]]:
    """One server process with an endpoint per ``endpoints`` entry (name -> settings, keys as
    ``--endpoint``), stopped by PID on exit. It starts (and imports torch/transformers) while
    ``prepare()`` writes ``model_dir`` (last, atomically) and anything the endpoints load."""
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(endpoints):
        ports = {name: free_port() for name in endpoints}
    cmd = [sys.executable, "-m", "tests.sglang_contract.server", "--model", str(model_dir),
           "--wait-for-model", "120"]
    for name, settings in endpoints.items():
        cmd += ["--endpoint", json.dumps({"port": ports[name], **settings})]
    with local_server(cmd, work / "server.log", ports.values(), timeout=120, ready=prepare,
                      cwd=ROOT):
        yield {name: ContractServer(name, f"http://127.0.0.1:{port}")
               for name, port in ports.items()}


@dataclass(frozen=True)
class Deployment:
    model_dir: Path
    servers: dict[str, ContractServer]


@pytest.fixture(scope="session")
def contract_deployment(tmp_path_factory) -> Deployment:
    """One server process with every endpoint of ``ENDPOINTS``. It starts (and imports
    torch/transformers) while this process writes the model it will serve."""
    work = tmp_path_factory.mktemp("sglang_contract")
    model_dir = work / "tiny_llama"
    with contract_process(work, model_dir, ENDPOINTS,
                          lambda: save_tiny_llama(model_dir)) as servers:
        yield Deployment(model_dir, servers)


@pytest.fixture(scope="session")
def tiny_llama_dir(contract_deployment) -> Path:
    """The HF checkpoint every contract endpoint serves."""
    return contract_deployment.model_dir


@pytest.fixture
def sglang_servers(contract_deployment) -> dict[str, ContractServer]:
    """The session's endpoints, each with faults, counters and prefix cache cleared."""
    servers = contract_deployment.servers
    for server in servers.values():
        server.reset()
    yield servers
    for server in servers.values():
        server.reset()  # also releases slow replies still waiting
