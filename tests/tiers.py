"""The test tiers, and the guard that keeps ``unit`` honest.

Every test belongs to exactly one tier:

- ``unit``: pure logic. No server, subprocess, network socket, Dagster instance or demo world;
  the whole tier answers in about a minute (``pytest -m unit``).
- ``integration``: real components started for real (moto S3, PostgreSQL, the MLflow
  server, the contract servers, DeepSpeed launches, Dagster instances, the training world).
- ``e2e``: the refresh loop, the demo, the deploy guide and the UI, end to end.

A test module (or class, or test) says its tier with ``pytestmark = pytest.mark.<tier>``;
an unmarked test is ``unit``. The guard below fails a ``unit`` test that starts a process,
opens a network connection or creates a Dagster instance, with a message naming what it did,
so the tier cannot quietly grow servers.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e")


_MODULE_TIER = re.compile(r"^pytestmark = pytest\.mark\.(unit|integration|e2e)\b", re.M)


def declared_tier(path: Path) -> str | None:
    """The tier a test module declares for all of its tests (``pytestmark = pytest.mark.X``
    at the top level), read from its text without importing it."""
    found = _MODULE_TIER.search(path.read_text(encoding="utf-8"))
    return found.group(1) if found else None


def skip_module(path: Path, markexpr: str) -> bool:
    """Under ``-m unit`` alone, a module declared ``integration`` or ``e2e`` holds nothing to
    run: it is not even imported (its imports of mlflow, trl, verl, selenium cost seconds)."""
    return (markexpr.strip() == "unit" and path.suffix == ".py"
            and path.name.startswith("test_") and declared_tier(path) in ("integration", "e2e"))


class UnitTierViolation(AssertionError):
    """A ``unit`` test did what only ``integration`` and ``e2e`` tests may do."""


def tier_of(item: pytest.Item) -> str:
    """The item's tier: its nearest tier marker (a test's own before its class's before its
    module's), ``unit`` when it has none."""
    for marker in item.iter_markers():
        if marker.name in TIERS:
            return marker.name
    return "unit"


def assign_tiers(items: list[pytest.Item]) -> None:
    """Give every unmarked item the ``unit`` marker, so ``-m unit`` selects it."""
    for item in items:
        if tier_of(item) == "unit" and item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.unit)


# session fixtures so costly that the tests sharing them must run on one xdist worker
SHARED_ON_ONE_WORKER = {"finished_loop": "the refresh loop"}


def plan_for_workers(items: list[pytest.Item]) -> None:
    """Order and group the run for ``pytest -n N --dist loadgroup``: the slowest tier first
    (e2e, then integration, then unit: the long poles start at once), each module on one
    worker (its module fixtures are built once), and the tests that share a costly session
    fixture on the same worker. Deterministic, as xdist requires of every worker."""
    rank = {"e2e": 0, "integration": 1, "unit": 2}
    items.sort(key=lambda item: rank[tier_of(item)])  # stable: file order within a tier
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        shared = [SHARED_ON_ONE_WORKER[f] for f in item.fixturenames
                  if f in SHARED_ON_ONE_WORKER]
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else module))


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierViolation(f"a unit test {what}: mark it integration (tests/tiers.py)")
    return refused


def guard_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forbid, for the test that runs now, what a ``unit`` test must not do."""
    from dagster import DagsterInstance  # before the patches: importing it runs `file`

    monkeypatch.setattr(DagsterInstance, "__init__", _refuse("created a Dagster instance"))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("started a process"))
    monkeypatch.setattr(os, "fork", _refuse("forked"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("spawned a process"), raising=False)
    monkeypatch.setattr(socket.socket, "connect", _refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("bound a network socket"))
