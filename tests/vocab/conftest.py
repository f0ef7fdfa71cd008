from __future__ import annotations

import shutil

import pytest

from pipeline.storage import Storage


@pytest.fixture
def storage(world_root, tmp_path) -> Storage:
    """A private copy of the world, so that tests can add vocab mappings and drafters."""
    root = tmp_path / "storage"
    shutil.copytree(world_root, root)
    return Storage(root.as_uri())


