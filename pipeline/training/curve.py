"""The training curve of a drafter: every optimizer step's metrics, kept whole.

The curve is a Parquet file in the drafter's dataset (``training_curve.parquet``, listed in
its manifest); the manifest itself keeps at most :data:`DISPLAY_POINTS` points of it, evenly
spread from the first step to the last, for display. Charts, MLflow and the checks read the
whole curve.

While a run trains, the worker prints each logged step as one line, :data:`METRICS_MARKER`
followed by JSON, which the parent passes on to a :class:`TrainingObserver` (the MLflow run
that lasts as long as the training).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from pipeline.contracts import Manifest
from pipeline.parquet import read_table, write_table
from pipeline.storage import Storage, WrittenObject

if TYPE_CHECKING:
    from pipeline.training.spec import TrainSpec

CURVE_FILE = "training_curve.parquet"
DISPLAY_POINTS = 200
METRICS_MARKER = "aerie-metrics "
CURVE_SCHEMA = pa.schema([("step", pa.int64()), ("lr", pa.float64()), ("loss", pa.float64()),
                          ("accuracy", pa.list_(pa.float64())),
                          ("sim_accept_length", pa.float64())])


def display_points(curve: Sequence[Mapping[str, Any]], n: int = DISPLAY_POINTS) -> list:
    """At most ``n`` points of ``curve``, evenly spread, always the first and the last."""
    if len(curve) <= n:
        return list(curve)
    picks = sorted({round(i * (len(curve) - 1) / (n - 1)) for i in range(n)})
    return [curve[i] for i in picks]


def write_curve(storage: Storage, prefix: str, curve: Sequence[Mapping[str, Any]]
                ) -> WrittenObject:
    table = pa.Table.from_pylist([{k: entry[k] for k in CURVE_SCHEMA.names}
                                  for entry in curve], schema=CURVE_SCHEMA)
    return write_table(storage, f"{prefix}/{CURVE_FILE}", table)


def read_curve(storage: Storage, prefix: str, manifest: Manifest) -> list[dict[str, Any]]:
    """The whole curve of a committed drafter, checked against its manifest; a drafter
    committed before curves were kept gives the points its manifest holds."""
    entry = next((f for f in manifest.files if f.path == CURVE_FILE), None)
    if entry is None:
        return list(manifest.meta["result"]["history"])
    return read_table(storage, f"{prefix}/{CURVE_FILE}", CURVE_SCHEMA, entry=entry).to_pylist()


def metrics_line(entry: Mapping[str, Any]) -> str:
    return METRICS_MARKER + json.dumps(entry, separators=(",", ":"))


def parse_metrics_line(line: str) -> dict[str, Any] | None:
    """The logged step a worker's line carries, or None for any other line."""
    at = line.find(METRICS_MARKER)
    return json.loads(line[at + len(METRICS_MARKER):]) if at >= 0 else None


class TrainingObserver(Protocol):
    """Follows one drafter's training (the MLflow run of :mod:`pipeline.release`)."""

    def started(self, spec: TrainSpec) -> None:
        """Training of ``spec`` starts (or resumes)."""

    def logged(self, entry: dict[str, Any]) -> None:
        """One logged step, while the run trains."""

    def failed(self) -> None:
        """Training or publishing failed."""

    def committed(self, spec: TrainSpec, curve: Sequence[Mapping[str, Any]],
                  drafter_dir: Callable[[], Path]) -> None:
        """The drafter of ``spec`` is committed (now, or by an earlier run): the whole
        curve and a local copy of its directory (made on demand)."""
