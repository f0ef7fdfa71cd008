"""The ``unit`` tier's guard refuses what a unit test must not do, and only there."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from dagster import DagsterInstance

from tests.tiers import UnitTierViolation


def test_a_unit_test_may_not_start_a_process():
    with pytest.raises(UnitTierViolation, match="started a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_unit_test_may_not_open_a_connection():
    with socket.socket() as s, pytest.raises(UnitTierViolation, match="connection"):
        s.connect(("127.0.0.1", 9))


def test_a_unit_test_may_not_create_a_dagster_instance():
    with pytest.raises(UnitTierViolation, match="Dagster instance"):
        DagsterInstance.ephemeral()


@pytest.mark.integration
def test_an_integration_test_may():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    with DagsterInstance.ephemeral() as instance:
        assert instance.get_runs() == []


def test_only_a_module_declared_outside_the_unit_tier_is_left_uncollected(tmp_path):
    from tests.tiers import declared_tier, skip_module

    cases = {"test_a.py": "import pytest\n\npytestmark = pytest.mark.integration\n",
             "test_b.py": "import pytest\n\npytestmark = pytest.mark.e2e\n",
             "test_c.py": "import pytest\n\n\n@pytest.mark.integration\ndef test_x():\n    pass\n",
             "test_d.py": "import pytest\n\npytestmark = pytest.mark.unit\n",
             "helpers.py": "import pytest\n\npytestmark = pytest.mark.e2e\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert [declared_tier(tmp_path / n) for n in sorted(cases)] == [
        "e2e", "integration", "e2e", None, "unit"]
    assert [n for n in sorted(cases) if skip_module(tmp_path / n, "unit")] == [
        "test_a.py", "test_b.py"]
    assert not any(skip_module(tmp_path / n, "not e2e") for n in cases)
    assert not any(skip_module(tmp_path / n, "") for n in cases)
