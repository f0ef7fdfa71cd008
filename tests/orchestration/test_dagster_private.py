"""The pin on :mod:`aerie.dagster_private`, the one module that uses Dagster's private API.

A Dagster upgrade that moves or renames what it uses fails here, not in a user's
``aerie demo``: the installed version is one the module was tested against, every private
name it imports still imports, and every keyword it passes (to a private name, or to a
``DagsterInstance`` method) is still a parameter. The checks read the module's own source
(AST), so they follow it with no list kept beside it. The integration test creates a run and
records ticks of a toy code location with it and reads them back as the UI does.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import dagster
import pytest

from aerie import dagster_private

SOURCE = Path(dagster_private.__file__).read_text(encoding="utf-8")


def private_imports(source: str) -> dict[str, tuple[str, str]]:
    """``{local name: (module, name)}`` of the ``from dagster._... import`` in ``source``."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dagster._"):
            found.update({a.asname or a.name: (node.module, a.name) for a in node.names})
    return found


def parameters(target) -> tuple[list[str], bool]:
    """The parameter names of a callable (a record's fields for a Dagster record), and
    whether it takes any keyword (``**kwargs``)."""
    if hasattr(target, "_fields"):  # @record / NamedTuple: the signature is (*args, **kw)
        return list(target._fields), False
    params = inspect.signature(target).parameters.values()
    return ([p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
            any(p.kind == p.VAR_KEYWORD for p in params))


def drift(source: str) -> list[str]:
    """What in ``source`` no longer matches the installed Dagster: a private name that does
    not import, an attribute of one that is gone, a keyword a callee no longer takes."""
    names, problems = {}, []
    for local, (module, name) in private_imports(source).items():
        try:
            names[local] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            problems.append(f"{module}.{name} does not import: {error}")

    def resolve(func: ast.expr):
        if isinstance(func, ast.Name):
            return names.get(func.id)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = (dagster.DagsterInstance if func.value.id == "instance"
                     else names.get(func.value.id))
            return getattr(owner, func.attr, None) if owner is not None else None
        return None

    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in names and not hasattr(names[node.value.id], node.attr)):
            problems.append(f"{node.value.id}.{node.attr} is gone (line {node.lineno})")
        if not isinstance(node, ast.Call) or (target := resolve(node.func)) is None:
            continue
        params, any_keyword = parameters(target)
        if inspect.isfunction(target) and params[:1] in (["self"], ["cls"]):
            params = params[1:]
        for kw in node.keywords:
            if kw.arg is not None and kw.arg not in params and not any_keyword:
                problems.append(f"{ast.unparse(node.func)} takes no {kw.arg!r} "
                                f"(line {node.lineno}; it takes {params})")
        if len(node.args) > len(params):
            problems.append(f"{ast.unparse(node.func)} takes {len(params)} positional "
                            f"arguments, line {node.lineno} passes {len(node.args)}")
    return problems


def test_the_installed_dagster_is_one_the_module_was_tested_against():
    minor = ".".join(dagster.__version__.split(".")[:2])
    assert minor in dagster_private.TESTED_DAGSTER, (
        f"dagster {dagster.__version__}: aerie/dagster_private.py was written against "
        f"{dagster_private.TESTED_DAGSTER}; check each private use and extend the pin")


def test_every_private_name_and_keyword_still_matches():
    assert len(private_imports(SOURCE)) == 10  # grows only on purpose: see the docstring
    assert drift(SOURCE) == []


def test_a_planted_drift_is_caught():
    planted = textwrap.dedent("""
        from dagster._core.remote_origin import RemoteJobOrigin
        from dagster._core.execution.api import execute_run
        from dagster._core.scheduler.instigation import TickStatus
        from dagster._core.no_such_module import Gone

        def f(instance, origin, job, run):
            RemoteJobOrigin(repository_origin=origin, pipeline_name="x")
            execute_run(job, run, instance, True, "extra")
            instance.create_run_for_job(job_def=job, external_pipeline_origin=origin)
            return TickStatus.MAYBE
    """)
    found = drift(planted)
    assert len(found) == 5, found
    for expected in ("dagster._core.no_such_module.Gone does not import",
                     "RemoteJobOrigin takes no 'pipeline_name'",
                     "execute_run takes 4 positional arguments",
                     "instance.create_run_for_job takes no 'external_pipeline_origin'",
                     "TickStatus.MAYBE is gone"):
        assert any(expected in f for f in found), (expected, found)


TOY = """
from dagster import Definitions, job, op

@op
def greet():
    return "hello"

@job(tags={"team": "toy"})
def hello():
    greet()

defs = Definitions(jobs=[hello])
"""


@pytest.mark.integration
def test_runs_and_ticks_are_recorded_as_the_daemon_records_them(tmp_path, monkeypatch,
                                                                 instance):
    """A run created here carries the location's origin (the job page's repository label)
    and the repository's code origin; ticks land in the history the Automation page reads."""
    from dagster import RunsFilter
    from dagster._core.scheduler.instigation import TickStatus

    module = f"aerie_toy_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - python_module:\n      module_name: {module}\n"
                         "      attribute: defs\n      location_name: toy\n")
    origin = dagster_private.repository_origin(workspace, "__repository__")

    run, job = dagster_private.create_run(
        instance, origin, module, "defs", "hello",
        {"execution": {"config": {"in_process": {}}}}, {"dagster/sensor_name": "s"})
    assert dagster_private.execute(job, run, instance).success
    label = {".dagster/repository": "__repository__@toy"}
    (found,) = instance.get_runs(RunsFilter(job_name="hello", tags=label))
    assert found.run_id == run.run_id and found.tags["team"] == "toy"
    assert found.remote_job_origin.location_name == "toy"
    assert found.job_code_origin.repository_origin.code_pointer.module == module

    ids = dagster_private.tick_ids(origin, "toy", "__repository__", "s")
    dagster_private.record_tick(instance, origin, "toy", "__repository__", "s", "sensor",
                                1.0, 2.0, [run.run_id], [], "nothing new", "c1")
    dagster_private.record_tick(instance, origin, "toy", "__repository__", "s", "sensor",
                                3.0, 4.0, [], [], "nothing new", "c1")
    skipped, launched = instance.get_ticks(*ids)  # newest first
    assert (launched.status, launched.run_ids, launched.cursor) == \
        (TickStatus.SUCCESS, [run.run_id], "c1")
    assert (skipped.status, skipped.skip_reason) == (TickStatus.SKIPPED, "nothing new")
