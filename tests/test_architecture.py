"""The layering of the code base, checked on the source (AST), never by importing it.

- ``pipeline/`` never imports ``dagster``;
- data flows one way: a stage of :data:`pipeline.STAGES` imports the foundation and earlier
  stages, never a later one; the foundation imports no stage; only ``checks`` and ``demo``
  sit on top;
- ``pipeline/`` imports none of ``assets``, ``jobs``, ``resources``; ``resources/`` imports
  neither ``assets`` nor ``jobs``; ``assets/`` never imports ``jobs``;
- ``aerie/`` (the command line) sits on top of everything: only ``tests/`` and the
  benchmarks that drive it (``bench/``) import it;
- nothing outside ``tests/`` imports ``tests``;
- Dagster's private API (``dagster._...``) is imported by :data:`DAGSTER_PRIVATE` alone
  (pinned by ``tests/orchestration/test_dagster_private.py``) and by tests;
- the first-party import graph, function-level imports included, has no cycle, and no module
  imports ``definitions`` (:func:`test_the_import_graph_has_no_cycle`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pipeline

ROOT = Path(__file__).resolve().parents[1]
CODE = ("pipeline", "assets", "jobs", "resources", "definitions.py", "aerie", "bench")
GROUPS = ("assets", "jobs", "resources", "tests", "definitions", "aerie", "bench")
DAGSTER_PRIVATE = "aerie.dagster_private"  # the one module that may import ``dagster._``


def imports(source: str, module: str = "", is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``source`` (of ``module``), relative ones made
    absolute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            target = _absolute(node, module, is_package)
            found += [(node.lineno, target)]
            # ``from pipeline import stage_pkg`` imports the package named after it
            if target == "pipeline":
                found += [(node.lineno, f"pipeline.{a.name}") for a in node.names]
            if target == "dagster":  # ``from dagster import _core`` is a private import too
                found += [(node.lineno, f"dagster.{a.name}") for a in node.names
                          if a.name.startswith("_")]
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` names, a relative one made absolute."""
    target = node.module or ""
    if node.level:
        base = module.split(".")[:len(module.split(".")) - node.level + is_package]
        target = ".".join(base + ([target] if target else []))
    return target


def layer_of(module: str) -> tuple[str, int] | None:
    """``(group, rank)`` of a first-party module: ranks order the pipeline's layers."""
    parts = module.split(".")
    top = parts[0]
    if top != "pipeline":
        return (top, 0) if top in GROUPS else None
    if len(parts) == 1:
        return ("pipeline", 0)
    sub = parts[1]
    if sub in pipeline.FOUNDATION:
        return ("pipeline", 0)
    if sub in pipeline.STAGES:
        return ("pipeline", 1 + pipeline.STAGES.index(sub))
    if sub in pipeline.ON_TOP:
        return ("pipeline", 1 + len(pipeline.STAGES))
    return ("pipeline", -1)  # unknown: every package must be placed


def violations(module: str, source: str, where: str, is_package: bool = False) -> list[str]:
    """Import edges from ``module`` (whose text is ``source``) that break the layering."""
    me = layer_of(module)
    out = []
    for line, target in imports(source, module, is_package):
        if target == "dagster" or target.startswith(("dagster.", "dagster_")):
            if me[0] == "pipeline":
                out.append(f"{where}:{line} imports {target} (the core is framework-free)")
            elif target.startswith("dagster._") and module != DAGSTER_PRIVATE \
                    and me[0] != "tests":
                out.append(f"{where}:{line} imports {target} (Dagster's private API is "
                           f"{DAGSTER_PRIVATE}'s alone)")
            continue
        other = layer_of(target)
        if other is None:
            continue
        if other[0] == "tests" and me[0] != "tests":
            out.append(f"{where}:{line} imports {target} (tests are never imported)")
        elif me[0] == "pipeline" and other[0] != "pipeline":
            out.append(f"{where}:{line} imports {target} (pipeline/ imports no adapter)")
        elif other[0] == "aerie" and me[0] not in ("aerie", "tests", "bench"):
            out.append(f"{where}:{line} imports {target} (the command line is on top)")
        elif me[0] == "pipeline" and (me[1] < 0 or other[1] < 0):
            out.append(f"{where}:{line} {module} → {target}: a package missing from "
                       "pipeline.STAGES / FOUNDATION / ON_TOP")
        elif me[0] == "pipeline" and other[1] > me[1]:
            out.append(f"{where}:{line} {module} imports the later {target}")
        elif me[0] == "assets" and other[0] == "jobs":
            out.append(f"{where}:{line} assets import jobs ({target})")
        elif me[0] == "resources" and other[0] in ("assets", "jobs"):
            out.append(f"{where}:{line} resources import {target}")
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def code_files() -> list[Path]:
    files = []
    for name in CODE:
        p = ROOT / name
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def test_every_pipeline_package_is_placed():
    packages = {p.name for p in (ROOT / "pipeline").iterdir()
                if (p / "__init__.py").is_file() or p.suffix == ".py"}
    packages = {p.removesuffix(".py") for p in packages} - {"__init__"}
    placed = set(pipeline.STAGES) | set(pipeline.FOUNDATION) | set(pipeline.ON_TOP)
    assert packages == placed


def test_the_code_base_is_layered():
    files = code_files()
    assert len(files) > 50
    found = [v for f in files
             for v in violations(module_name(f), f.read_text(encoding="utf-8"),
                                 str(f.relative_to(ROOT)), f.name == "__init__.py")]
    assert found == []


def test_tests_are_imported_by_nobody_but_tests():
    assert violations("aerie.cli", "from tests.e2e import helpers\n", "aerie/cli.py") == \
        ["aerie/cli.py:1 imports tests.e2e (tests are never imported)"]


def test_modules_import_helpers_never_a_test_module():
    """Shared test code lives in conftests and helper modules: importing a ``test_*``
    module would run its tests' module set-up and collect its fixtures twice."""

    def offenders(module: str, source: str, where: str) -> list[str]:
        return [f"{where}:{line} imports {target}" for line, target in imports(source, module)
                if target.startswith("tests.") and target.split(".")[-1].startswith("test_")]

    found = [o for f in sorted((ROOT / "tests").rglob("*.py"))
             for o in offenders(module_name(f), f.read_text(encoding="utf-8"),
                                str(f.relative_to(ROOT)))]
    assert found == []
    assert offenders("tests.a.test_b", "from .test_c import x\n", "tests/a/test_b.py") == \
        ["tests/a/test_b.py:1 imports tests.a.test_c"]


def test_a_planted_upward_import_is_caught():
    """Each rule fails on an edge planted in memory (the source tree is never written)."""
    planted = {
        ("pipeline.training.stage", "from pipeline.release.ledger import ServingLedger\n"):
            "pipeline.training.stage imports the later pipeline.release.ledger",
        ("pipeline.capture.stage", "import pipeline.evaluation.engine\n"):
            "pipeline.capture.stage imports the later pipeline.evaluation.engine",
        ("pipeline.eagle3.config", "from pipeline.capture.base import CaptureBackend\n"):
            "pipeline.eagle3.config imports the later pipeline.capture.base",
        ("pipeline.layout", "from pipeline import snapshot\n"):
            "pipeline.layout imports the later pipeline.snapshot",
        ("pipeline.vocab.stage", "from dagster import asset\n"):
            "imports dagster (the core is framework-free)",
        ("pipeline.storage", "from resources.home import aerie_home\n"):
            "imports resources.home (pipeline/ imports no adapter)",
        ("assets.summary", "from jobs.drafter import DRAFTER_ASSETS\n"):
            "assets import jobs (jobs.drafter)",
        ("resources.trainer", "from assets.partitions import step_of\n"):
            "resources import assets.partitions",
        ("pipeline.capture.stage", "from ..release import ledger\n"):
            "pipeline.capture.stage imports the later pipeline.release",
        ("bench.extraction", "from tests.capture import test_shards\n"):
            "imports tests.capture (tests are never imported)",
        ("jobs.refresh", "from aerie.launch import definitions\n"):
            "imports aerie.launch (the command line is on top)",
        ("definitions", "import aerie.cli\n"):
            "imports aerie.cli (the command line is on top)",
        ("assets.release", "from aerie import status\n"):
            "imports aerie (the command line is on top)",
        ("resources.home", "from aerie.cli import INSTANCE_YAML\n"):
            "imports aerie.cli (the command line is on top)",
        ("pipeline.demo.world", "from aerie.demo import RefreshLoop\n"):
            "imports aerie.demo (pipeline/ imports no adapter)",
        ("aerie.launch", "from dagster._core.execution.api import execute_run\n"):
            "imports dagster._core.execution.api (Dagster's private API is",
        ("assets.release", "import dagster._core.storage.tags\n"):
            "imports dagster._core.storage.tags (Dagster's private API is",
        ("resources.home", "from dagster import _check\n"):
            "imports dagster._check (Dagster's private API is",
    }
    for (module, source), expected in planted.items():
        found = violations(module, source, "probe.py")
        assert len(found) == 1 and expected in found[0], (module, found)
    # and the allowed directions pass
    assert violations("pipeline.release.serve", "from pipeline.training.stage import run\n",
                      "probe.py") == []
    assert violations("pipeline.training.stage", "from pipeline.serving_now import "
                      "serving_history\n", "probe.py") == []
    assert violations("pipeline.demo.world", "from pipeline.snapshot.writer import "
                      "SnapshotWriter\n", "probe.py") == []
    for module in ("aerie.cli", "tests.e2e.loop", "bench.closed_loop"):
        assert violations(module, "from aerie.demo import RefreshLoop\n", "probe.py") == []
    assert violations("aerie.demo", "from jobs.refresh import refresh_sensor\n"
                      "from assets.partitions import step_of\n", "probe.py") == []
    for module in (DAGSTER_PRIVATE, "tests.e2e.test_demo_cli"):
        assert violations(module, "from dagster._core.execution.api import execute_run\n"
                          "from dagster import DagsterInstance\n", "probe.py") == []


def import_graph(sources: dict[str, str], packages: frozenset[str] = frozenset()
                 ) -> dict[str, set[str]]:
    """The first-party modules each module of ``sources`` (``{module: source}``; modules in
    ``packages`` are ``__init__`` files) imports, at any depth of its body (function-level
    imports count: a deferred import closes a cycle as surely as one at the top).

    ``from X import y`` is an edge to ``X.y`` when that module exists, else to ``X``; an
    import of a name that is not a module goes to the nearest enclosing module. Modules
    outside ``sources`` (the standard library, dependencies) are left out."""

    def nearest(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        targets = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets |= {nearest(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
                base = _absolute(node, module, module in packages)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in sources
                            else nearest(base) for a in node.names}
        graph[module] = targets - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, with
    an explicit stack: the graph has hundreds of modules), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    """No import cycle among the first-party modules, deferred or not, and no module imports
    ``definitions``: it is the code location Dagster loads by name. The command line, which
    must run its jobs, loads it the same way, by module name (``aerie.launch.definitions()``,
    whose ``DEFINITIONS_MODULE`` is the one the workspace names), so the definitions are a
    leaf no code depends on."""
    files = code_files()
    sources = {module_name(f): f.read_text(encoding="utf-8") for f in files}
    packages = frozenset(module_name(f) for f in files if f.name == "__init__.py")
    graph = import_graph(sources, packages)
    assert {"aerie.cli", "definitions", "jobs.drafter", "assets.monitor"} <= set(graph)
    assert cycles(graph) == [], "import cycles: " + "; ".join(
        " ↔ ".join(c) for c in cycles(graph))
    assert sorted(m for m, targets in graph.items() if "definitions" in targets) == []


def test_a_planted_function_level_cycle_is_caught():
    """The cycle check sees imports inside functions and ``from X import module``, in sources
    held in memory (the tree is never written)."""
    sources = {
        "a": "import c\n\ndef f():\n    import b\n",
        "b": "from a import f\n",
        "c": "",
        "p": "",
        "p.x": "def g():\n    from p import y\n",
        "p.y": "from . import x\n",
        "q": "from p import x\n",
    }
    graph = import_graph(sources, frozenset({"p"}))
    assert graph["a"] == {"b", "c"} and graph["p.y"] == {"p.x"} and graph["q"] == {"p.x"}
    assert cycles(graph) == [["a", "b"], ["p.x", "p.y"]]
    del sources["b"]
    assert cycles(import_graph(sources, frozenset({"p"}))) == [["p.x", "p.y"]]
    # a longer loop is one component, and a module importing itself is none
    ring = {"r1": "import r2\n", "r2": "def h():\n    from r3 import z\n",
            "r3": "import r1\nimport r3\n"}
    assert cycles(import_graph(ring)) == [["r1", "r2", "r3"]]


def test_step_directories_parse_strictly():
    from pipeline.layout import committed_steps, parse_step_dir, step_dir

    for step in (0, 7, 999_999, 1_000_000, 12_345_678):
        assert parse_step_dir(step_dir(step)) == step
    for bad in ("step=0003", "step=²00003", "step=0000012", "step=00001a", "steps=000001"):
        assert parse_step_dir(bad) is None, bad
    keys = ["rollouts/step=000003/_manifest.json", "rollouts/step=1000000/_manifest.json",
            "rollouts/step=000004/part-00000.parquet", "rollouts/step=0005/_manifest.json"]
    assert committed_steps(keys, "rollouts") == [3, 1_000_000]
