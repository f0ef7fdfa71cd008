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
