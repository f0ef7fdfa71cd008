"""The dump-reader registry: every registered name builds its reader, whose ``framework`` is
that name and which has the :class:`~pipeline.adapters.ingest.DumpReader` members."""

from __future__ import annotations

import pytest

from pipeline.adapters.ingest import DumpReader
from pipeline.adapters.readers import READERS, reader_for


@pytest.mark.parametrize("name", sorted(READERS))
def test_every_registered_reader_builds_under_its_name(name):
    reader = reader_for(name)
    assert reader.framework == name
    members = {m for m in vars(DumpReader) if not m.startswith("_")} | \
        set(DumpReader.__annotations__)
    assert {"framework", "checkpoint_pattern", "step_files", "read"} <= members
    assert [m for m in sorted(members) if not hasattr(reader, m)] == []


def test_an_unknown_framework_names_the_known_ones():
    with pytest.raises(ValueError, match=r"no dump reader 'openrlhf': one of \['nemo-rl', "):
        reader_for("openrlhf")
