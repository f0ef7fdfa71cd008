"""Runs of the embedded default, created the way the daemon creates them.

``aerie demo`` and the CLI tick the sensors themselves and execute the runs they request in
this process (no daemon, no run worker to start). Each run is still created on the instance
with the origin of the code location ``aerie`` (the one ``aerie ui`` serves), the job's own
tags, the partition and who asked for it (``dagster/sensor_name`` for a sensor's request), so
the Dagster UI lists it on its job page, in the Overview timeline and as launched by its
sensor, exactly like a run the daemon launched. No public Dagster API creates such a run or
records a tick: the private calls that do are :mod:`aerie.dagster_private`'s, pinned by a test.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from dagster import DagsterInstance, DagsterRun, RunRequest

LOCATION = "aerie"
REPOSITORY = "__repository__"  # the repository every Definitions object is served as
# The code location's module and attribute, as the workspace names them (the checkout's
# workspace.yaml too): the CLI loads them by name, as Dagster does, and never imports them
DEFINITIONS_MODULE, DEFINITIONS_ATTRIBUTE = "definitions", "defs"
WORKSPACE_YAML = f"""load_from:
  - python_module:
      module_name: {DEFINITIONS_MODULE}
      attribute: {DEFINITIONS_ATTRIBUTE}
      location_name: {LOCATION}
"""


def definitions():
    """The code location's ``Definitions``, loaded by module name as Dagster loads the
    workspace's ``python_module`` (the module is imported once, then cached by Python)."""
    return getattr(importlib.import_module(DEFINITIONS_MODULE), DEFINITIONS_ATTRIBUTE)


def in_process(verbose: bool = False) -> dict:
    """Run config of a run the CLI executes itself: every step in this process (one import
    of torch, not one per step; a daemon-launched run keeps the job's own executor), and
    Dagster's console log at WARNING unless ``verbose`` (the event log keeps every line)."""
    level = "DEBUG" if verbose else "WARNING"
    return {"execution": {"config": {"in_process": {}}},
            "loggers": {"console": {"config": {"log_level": level}}}}


class RunFailed(RuntimeError):
    """A run the CLI executed failed; the message names the run, its partition and the error
    of the step that failed."""


def workspace_file(dagster_home: Path) -> Path:
    """``$DAGSTER_HOME/workspace.yaml``: the code location ``aerie`` from the installed
    ``definitions`` module, so ``aerie ui`` works from any directory."""
    path = dagster_home / "workspace.yaml"
    if not path.exists() or path.read_text() != WORKSPACE_YAML:
        path.write_text(WORKSPACE_YAML)
    return path


def repository_origin(instance: DagsterInstance):
    """The origin of the code location ``aerie`` as the workspace beside ``instance``
    declares it (``<instance home>/workspace.yaml``)."""
    from aerie import dagster_private

    home = Path(instance.root_directory)
    return dagster_private.repository_origin(workspace_file(home), REPOSITORY)


def tick_ids(instance: DagsterInstance, name: str) -> tuple[str, str]:
    """``(origin_id, selector_id)`` of sensor or schedule ``name`` of the code location:
    what ``DagsterInstance.get_ticks`` (the *Automation* page) looks its ticks up by."""
    from aerie import dagster_private

    return dagster_private.tick_ids(repository_origin(instance), LOCATION, REPOSITORY, name)


def record_tick(instance: DagsterInstance, name: str, kind: str, started: float,
                runs: list[DagsterRun], skip_reason: str | None = None,
                cursor: str | None = None) -> None:
    """Keep the tick of sensor or schedule ``name`` (``kind``: "sensor" | "schedule") in the
    instance's tick history, as the daemon does, so its *Automation* page shows the ticks
    that launched the runs."""
    import time

    from aerie import dagster_private

    dagster_private.record_tick(
        instance, repository_origin(instance), LOCATION, REPOSITORY, name, kind, started,
        ended=time.time(), run_ids=[r.run_id for r in runs],
        run_keys=[r.tags["dagster/run_key"] for r in runs if "dagster/run_key" in r.tags],
        skip_reason=skip_reason, cursor=cursor)


def execute(instance: DagsterInstance, job_name: str, request: RunRequest,
            run_config: dict, launched_by: dict[str, str],
            created: list[DagsterRun] | None = None) -> DagsterRun:
    """Create the run of ``request`` on ``instance`` with the code location's origin and
    execute it here; raise :class:`RunFailed` if it fails.

    ``run_config`` is the full run config (the request's merged with any override);
    ``launched_by`` the tags that say who asked (e.g. ``{"dagster/sensor_name": ...}``);
    ``created`` collects the run as soon as it exists (before it executes).
    """
    from aerie import dagster_private

    tags = {**(request.tags or {}), **launched_by, **_executor_tags()}
    if request.partition_key is not None:
        tags["dagster/partition"] = request.partition_key
    if request.run_key:
        tags["dagster/run_key"] = request.run_key
    run, job = dagster_private.create_run(
        instance, repository_origin(instance), DEFINITIONS_MODULE, DEFINITIONS_ATTRIBUTE,
        job_name, run_config, tags)
    if created is not None:
        created.append(run)
    result = dagster_private.execute(job, run, instance)
    if not result.success:
        where = f" {request.partition_key}" if request.partition_key else ""
        raise RunFailed(f"{job_name}{where} failed (run {run.run_id}): {_failure(result)}")
    return instance.get_run_by_id(run.run_id)


HOST_TAG, PID_TAG = "aerie/executed_on", "aerie/executed_by_pid"
IN_FLIGHT = ("NOT_STARTED", "STARTING", "STARTED")


def _executor_tags() -> dict[str, str]:
    """Which process executes a run the CLI created (see :func:`fail_orphaned_runs`)."""
    import socket

    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


def fail_orphaned_runs(instance: DagsterInstance) -> list[str]:
    """Mark as failed the runs an ``aerie`` process on this host created and never finished
    because it died (killed, out of memory): no daemon watches them, and a refresh left
    "in flight" would stop the refresh sensor and the schedule for good. Returns their ids."""
    import socket

    from dagster import DagsterRunStatus, RunsFilter

    orphans = []
    for run in instance.get_runs(RunsFilter(
            statuses=[DagsterRunStatus(s) for s in IN_FLIGHT],
            tags={HOST_TAG: socket.gethostname()})):
        pid = int(run.tags[PID_TAG])
        if pid == os.getpid() or _alive(pid):
            continue
        instance.report_run_failed(run, f"the aerie process that executed it (pid {pid}) "
                                        "is gone")
        orphans.append(run.run_id)
    return orphans


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _failure(result) -> str:
    """The error message of the first failed step (or of the run)."""
    for event in result.all_events:
        if event.is_step_failure or event.is_run_failure:
            error = getattr(event.event_specific_data, "error", None)
            where = f"step {event.step_key}: " if event.step_key else ""
            if error is not None:
                cause = error.cause.message.strip() if error.cause else ""
                return where + (error.message.strip() + (f" ({cause})" if cause else ""))
            return where + (event.message or "failed")
    return "failed"
