"""The private Dagster API Aerie uses, all of it, and why no public API does the job.

``aerie demo`` and the CLI play the daemon: they create runs and record sensor ticks that the
Dagster UI must show exactly as the daemon's. Dagster 1.13 has no public API for either:

- ``execute_job`` (public) creates its run *without* a code location origin, so the run is on
  no job page of the location ``aerie`` and carries no ``.dagster/repository`` tag. The run
  must be created first with the origin of the location as ``workspace.yaml`` declares it
  (``location_origins_from_yaml_paths``, ``RemoteRepositoryOrigin``, ``RemoteJobOrigin``) and
  the job's code origin (``ReconstructableRepository``, the repository pointer the daemon's
  runs carry, not a reconstructor function's), then executed as it is: ``execute_run`` is
  the only way to execute a run that already exists.
- ``build_sensor_context`` (public) evaluates a sensor but keeps no tick; the *Automation*
  page lists the instance's tick history, which only ``TickData`` (with ``InstigatorType``,
  ``TickStatus``, and the ids of ``RemoteInstigatorOrigin`` and ``InstigatorSelector``)
  writes.

Nothing else in the repository imports ``dagster._`` (``tests/test_architecture.py``), and
``tests/orchestration/test_dagster_private.py`` pins this module: the installed Dagster is
one of :data:`TESTED_DAGSTER`, every private name imports, and every keyword this module
passes to one is still a parameter of it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from dagster import DagsterInstance, DagsterRun
from dagster._core.definitions.reconstruct import ReconstructableRepository
from dagster._core.definitions.selector import InstigatorSelector
from dagster._core.execution.api import execute_run
from dagster._core.remote_origin import (
    RemoteInstigatorOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.scheduler.instigation import InstigatorType, TickData, TickStatus
from dagster._core.workspace.load import location_origins_from_yaml_paths

TESTED_DAGSTER = ("1.13",)  # the minor versions this module was written and tested against


def repository_origin(workspace_yaml: Path, repository: str) -> RemoteRepositoryOrigin:
    """The origin of ``repository`` in the one code location ``workspace_yaml`` declares,
    the same origin (and so the same ids) the webserver and the daemon derive from it."""
    (location,) = location_origins_from_yaml_paths(yaml_paths=[str(workspace_yaml)])
    return RemoteRepositoryOrigin(code_location_origin=location, repository_name=repository)


@cache
def _repository(module: str, attribute: str) -> ReconstructableRepository:
    working_directory = os.path.dirname(importlib.import_module(module).__file__)
    return ReconstructableRepository.for_module(module=module, fn_name=attribute,
                                                working_directory=working_directory)


def create_run(instance: DagsterInstance, origin: RemoteRepositoryOrigin, module: str,
               attribute: str, job_name: str, run_config: Mapping,
               tags: Mapping[str, str]):
    """Create the run of ``job_name`` (of the ``Definitions`` at ``module.attribute``) on
    ``instance`` with the code location's origin, as the daemon does; ``tags`` go over the
    job's own. Returns ``(run, job)``; :func:`execute` runs it."""
    job = _repository(module, attribute).get_reconstructable_job(job_name)
    definition = job.get_definition()
    run = instance.create_run_for_job(
        job_def=definition, run_config=run_config, tags={**definition.run_tags, **tags},
        remote_job_origin=RemoteJobOrigin(repository_origin=origin, job_name=job_name),
        job_code_origin=job.get_python_origin())
    return run, job


def execute(job, run: DagsterRun, instance: DagsterInstance):
    """Execute the run :func:`create_run` created, in this process; its result (events)."""
    return execute_run(job=job, dagster_run=run, instance=instance)


def record_tick(instance: DagsterInstance, origin: RemoteRepositoryOrigin, location: str,
                repository: str, name: str, kind: str, started: float, ended: float,
                run_ids: Sequence[str], run_keys: Sequence[str],
                skip_reason: str | None, cursor: str | None) -> None:
    """Add a tick of sensor or schedule ``name`` (``kind``: "sensor" | "schedule") to the
    instance's tick history: SUCCESS when it launched runs, else SKIPPED with its reason."""
    origin_id, selector_id = tick_ids(origin, location, repository, name)
    instance.create_tick(TickData(
        instigator_origin_id=origin_id, instigator_name=name, selector_id=selector_id,
        instigator_type=InstigatorType.SENSOR if kind == "sensor" else InstigatorType.SCHEDULE,
        status=TickStatus.SUCCESS if run_ids else TickStatus.SKIPPED, timestamp=started,
        run_ids=list(run_ids), run_keys=list(run_keys),
        skip_reason=None if run_ids else skip_reason, cursor=cursor, end_timestamp=ended))


def tick_ids(origin: RemoteRepositoryOrigin, location: str, repository: str,
             name: str) -> tuple[str, str]:
    """``(origin_id, selector_id)`` of sensor or schedule ``name``, the keys of its tick
    history (``DagsterInstance.get_ticks``)."""
    return (RemoteInstigatorOrigin(repository_origin=origin, instigator_name=name).get_id(),
            InstigatorSelector(location_name=location, repository_name=repository,
                               name=name).get_id())
