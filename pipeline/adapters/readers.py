"""The dump readers by name (what ``aerie ingest`` and the dump sensor are configured with)."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.adapters import frameworks
from pipeline.adapters.dump_readers import NemoRLReader, SlimeReader
from pipeline.adapters.ingest import DumpReader
from pipeline.adapters.text_dumps import TRLTextReader, VerlTextReader

FRAMEWORKS: dict[str, Callable[[], DumpReader]] = {
    "nemo-rl": NemoRLReader, "slime": SlimeReader,
    "verl-text": VerlTextReader, "trl-text": TRLTextReader,
}
assert tuple(sorted(FRAMEWORKS)) == frameworks.FRAMEWORKS


def reader_for(name: str) -> DumpReader:
    if name not in FRAMEWORKS:
        raise ValueError(f"no dump reader {name!r}: one of {sorted(FRAMEWORKS)}")
    return FRAMEWORKS[name]()
