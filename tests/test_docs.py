"""The documentation stays true to the code: the generated reference pages are what
docs/gen_reference.py writes now, the README stays short and its links resolve, and the
MkDocs nav lists every page (CI also runs ``mkdocs build --strict``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import dagster  # noqa: F401  (imported at collection: its first import runs `file`)
import pytest
import yaml

pytestmark = pytest.mark.unit  # in-process only: no Dagster instance, server or subprocess

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_pages_are_current(tmp_path):
    generator = load_generator()
    written = generator.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(generator.PAGES)
    stale = [p.name for p in written
             if not (DOCS / "reference" / p.name).exists()
             or (DOCS / "reference" / p.name).read_text() != p.read_text()]
    assert stale == [], f"run `python docs/gen_reference.py` and commit: {stale} differ"


def test_the_generator_covers_every_resource_of_the_definitions():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from definitions import defs

    assert set(load_generator().FACTORIES) == set(defs.resources)


def test_the_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []


def test_the_site_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            if isinstance(value, list):
                yield from pages(value)
            else:
                yield value

    listed = set(pages(config["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - listed == set() and listed - on_disk == set()
