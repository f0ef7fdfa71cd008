"""The core stays framework-free: nothing under pipeline/ imports dagster."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dagster_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                  if n == "dagster" or n.startswith(("dagster.", "dagster_"))]
    return found


def test_pipeline_never_imports_dagster():
    files = sorted((ROOT / "pipeline").rglob("*.py"))
    assert len(files) > 5
    assert [hit for f in files for hit in dagster_imports(f)] == []


def test_the_guard_catches_an_import(tmp_path):
    bad = ROOT / "pipeline" / "_guard_probe.py"
    try:
        bad.write_text("import os\nfrom dagster import asset\n")
        assert dagster_imports(bad) == ["pipeline/_guard_probe.py:2 imports dagster"]
    finally:
        bad.unlink()
