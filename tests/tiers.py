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


# modules whose tests share a costly session fixture: one xdist worker runs them all, so it
# is built once (a module that starts using one must be added here: plan_for_workers checks)
SHARED_SCOPES = {"tests/e2e/test_refresh_loop.py": "the refresh loop",
                 "tests/e2e/test_moved_state.py": "the refresh loop"}
SHARED_FIXTURES = {"finished_loop": "the refresh loop"}


def plan_for_workers(items: list[pytest.Item]) -> None:
    """Order the run for ``pytest -n N`` (:class:`ModuleScheduling`): the slowest tier first
    (e2e, then integration, then unit: the long poles start at once), file order within a
    tier; and check that every test sharing a costly session fixture is in a module that
    :data:`SHARED_SCOPES` keeps on that fixture's worker. Deterministic, as xdist requires of
    every worker."""
    rank = {"e2e": 0, "integration": 1, "unit": 2}
    items.sort(key=lambda item: rank[tier_of(item)])  # stable
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        for fixture, scope in SHARED_FIXTURES.items():
            if fixture in item.fixturenames and SHARED_SCOPES.get(module) != scope:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture}: add {module} to "
                                        f"SHARED_SCOPES in tests/tiers.py")


def module_scheduling(config, log):
    """xdist's scheduler for this suite: each module's tests on one worker (its module
    fixtures built once), the modules of :data:`SHARED_SCOPES` together, the modules in
    collection order (:func:`plan_for_workers`), not by size as xdist reorders by default."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_SCOPES.get(module, module)

    return ModuleScheduling(config, log)


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierViolation(f"a unit test {what}: mark it integration (tests/tiers.py)")
    return refused


def guard_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forbid, for the test that runs now, what a ``unit`` test must not do."""
    # imported before the patches: importing dagster runs `file`, and matplotlib's first
    # import on a machine builds its font cache with `fc-list` (a fresh clone's first
    # `pytest -m unit`, before any chart was drawn)
    import matplotlib.font_manager  # noqa: F401
    from dagster import DagsterInstance

    monkeypatch.setattr(DagsterInstance, "__init__", _refuse("created a Dagster instance"))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("started a process"))
    monkeypatch.setattr(os, "fork", _refuse("forked"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("spawned a process"), raising=False)
    monkeypatch.setattr(socket.socket, "connect", _refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("bound a network socket"))
