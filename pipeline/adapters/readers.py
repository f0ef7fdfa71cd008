"""The dump readers, registered once by name: what ``aerie ingest FRAMEWORK``, the
``ingest`` resource and the ``dump_sensor`` are configured with.

Adding a reader is its class (a :class:`~pipeline.adapters.ingest.DumpReader` whose
``framework`` is its name) and one line in :data:`READERS`. The registry names each class by
its import path, so configuration (the command line's choices, the resource's check) reads
the names without importing the readers and pyarrow behind them; :func:`reader_for` imports
the one asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.adapters.ingest import DumpReader

READERS: dict[str, str] = {
    "nemo-rl": "pipeline.adapters.dump_readers:NemoRLReader",
    "slime": "pipeline.adapters.dump_readers:SlimeReader",
    "trl-text": "pipeline.adapters.text_dumps:TRLTextReader",
    "verl-text": "pipeline.adapters.text_dumps:VerlTextReader",
}


def reader_for(name: str) -> DumpReader:
    """A new reader of framework ``name`` (ValueError naming the known ones otherwise)."""
    if name not in READERS:
        raise ValueError(f"no dump reader {name!r}: one of {sorted(READERS)}")
    module, attribute = READERS[name].split(":")
    return getattr(importlib.import_module(module), attribute)()
