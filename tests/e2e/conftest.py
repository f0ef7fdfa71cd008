"""The finished refresh loop (tests/e2e/loop.py), built once per session and shared by the
modules that read it; each module enters its environment through :func:`home_env`."""

from __future__ import annotations

import pytest

from tests.e2e.loop import Loop, home_env, run_loop


@pytest.fixture(scope="session")
def finished_loop(tmp_path_factory) -> Loop:
    """Never written to after it is built: tests that change state work on a copy."""
    home = tmp_path_factory.mktemp("loop") / "home"
    with home_env(home):
        return run_loop(home)


@pytest.fixture(scope="module")
def loop(finished_loop):
    with home_env(finished_loop.home):
        yield finished_loop


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (the UI tests save a screenshot when their
    call phase failed)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
