"""Aerie's own resume checkpoints: safetensors + JSON, a completeness marker written last.

A checkpoint of optimizer step ``n`` is the directory ``<root>/step-NNNNNNNN/``:

=========================  ============================================================
``model.safetensors``      fp32 master weights by parameter name (rank 0)
``optimizer.safetensors``  ``<moment>/<name>`` (e.g. ``exp_avg/fc.weight``), unpartitioned
``rng-rankRRRRR.safetensors``  each rank's torch CPU (and CUDA) generator state, uint8
``state.json``             step, optimizer step + param-group hyper-parameters, scheduler
                           state, data position, metric accumulators, python RNG, identity
``_COMPLETE``              JSON {file: [bytes, sha256]}; written LAST
=========================  ============================================================

Invariants:

- No pickle anywhere: tensors go to safetensors, everything else to JSON; a value that is
  neither (a tensor-valued ``lr``, an object in the scheduler state) is refused with its path.
- Writes: every rank writes into ``.step-NNNNNNNN.tmp/``; after a barrier rank 0 renames it to
  ``step-NNNNNNNN/`` and then writes ``_COMPLETE`` atomically (temp + rename). A directory
  without the marker, or whose files no longer hash to it, is torn and never loaded.
- Resume picks the newest complete checkpoint; DeepSpeed's own ``latest`` file (written
  without temp-and-rename, loaded with pickle) is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.formats import CHECKPOINT_SCHEMA_VERSION
from pipeline.training.engine_state import EngineState, UnsupportedStateError

log = logging.getLogger(__name__)

MARKER = "_COMPLETE"
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# -- JSON without surprises --------------------------------------------------------------
def to_json_value(x: Any, path: str = "state") -> Any:
    """``x`` as JSON (tuples tagged so they come back as tuples); refuses anything else."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return {"__float__": repr(x)} if x != x or x in (float("inf"), float("-inf")) else x
    if isinstance(x, tuple):
        return {"__tuple__": [to_json_value(v, f"{path}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [to_json_value(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, Mapping) and all(isinstance(k, str) for k in x):
        return {k: to_json_value(v, f"{path}.{k}") for k, v in x.items()}
    raise UnsupportedStateError(f"{path}: a {type(x).__name__} cannot be checkpointed as "
                                "JSON (only numbers, strings, bools, None, lists, tuples, "
                                "string-keyed dicts)")


def from_json_value(x: Any) -> Any:
    if isinstance(x, list):
        return [from_json_value(v) for v in x]
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(from_json_value(v) for v in x["__tuple__"])
        if set(x) == {"__float__"}:
            return float(x["__float__"])
        return {k: from_json_value(v) for k, v in x.items()}
    return x


# -- the checkpoint ------------------------------------------------------------------------
@dataclass(eq=False)
class Checkpoint:
    """Everything a run needs to continue exactly where it stopped."""

    step: int
    engine: EngineState
    extra: dict[str, Any]  # JSON-safe: scheduler, position, metrics, identity, …
    rng: dict[str, torch.Tensor]  # this rank's generator states
    python_rng: Any = None


def rng_state() -> tuple[dict[str, torch.Tensor], Any]:
    """This process's torch (CPU + CUDA) and python RNG states."""
    import random

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    return tensors, random.getstate()


def set_rng_state(tensors: Mapping[str, torch.Tensor], python_state: Any) -> None:
    import random

    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    if python_state is not None:
        version, internal, gauss = python_state
        random.setstate((version, tuple(internal), gauss))


def save_checkpoint(root: Path, ckpt: Checkpoint, *, rank: int, barrier: Callable[[], None],
                    keep: int = 2) -> Path | None:
    """Write ``ckpt`` (every rank calls; rank 0 publishes). Returns the directory on rank 0."""
    root = Path(root)
    final = root / checkpoint_name(ckpt.step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in (tmp, final):  # leftovers of a killed run: no marker, never loaded
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir()
    barrier()
    save_file({k: v.contiguous() for k, v in ckpt.rng.items()},
              str(tmp / f"rng-rank{rank:05d}.safetensors"))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ckpt.engine.params.items()},
                  str(tmp / "model.safetensors"))
        save_file({f"{k}/{n}": v.contiguous() for k, d in ckpt.engine.moments.items()
                   for n, v in d.items()}, str(tmp / "optimizer.safetensors"))
        state = {"schema_version": CHECKPOINT_SCHEMA_VERSION, "step": ckpt.step,
                 "optimizer_step": ckpt.engine.optimizer_step,
                 "moments": sorted(ckpt.engine.moments),
                 "param_groups": ckpt.engine.param_groups,
                 "python_rng": ckpt.python_rng, "extra": ckpt.extra}
        (tmp / "state.json").write_text(json.dumps(to_json_value(state), sort_keys=True))
    barrier()  # every rank's files are in tmp
    if rank != 0:
        return None
    files = {}
    for p in sorted(tmp.iterdir()):
        _fsync_file(p)
        files[p.name] = [p.stat().st_size, _sha256(p)]
    _fsync_dir(tmp)
    os.replace(tmp, final)
    write_atomic(final / MARKER, json.dumps({"files": files}, sort_keys=True).encode())
    _fsync_dir(root)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Directories under ``root`` with a marker, oldest first (hashes not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def verify(directory: Path) -> list[str]:
    """Problems with a checkpoint directory; empty when it is complete and intact."""
    marker = directory / MARKER
    if not marker.is_file():
        return [f"{directory}: no {MARKER} marker (torn checkpoint)"]
    problems = []
    for name, (size, digest) in json.loads(marker.read_text())["files"].items():
        p = directory / name
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != size or _sha256(p) != digest:
            problems.append(f"{p}: does not match the marker")
    return problems


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete, intact checkpoint under ``root`` (torn ones are skipped)."""
    for directory in reversed(complete_checkpoints(root)):
        problems = verify(directory)
        if not problems:
            return directory
        log.warning("skipping checkpoint %s: %s", directory, "; ".join(problems))
    return None


def load_checkpoint(directory: Path, rank: int) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` for ``rank``."""
    directory = Path(directory)
    state = from_json_value(json.loads((directory / "state.json").read_text()))
    if state["schema_version"] != CHECKPOINT_SCHEMA_VERSION:
        raise ValueError(f"{directory}: checkpoint schema {state['schema_version']} is not "
                         f"{CHECKPOINT_SCHEMA_VERSION}")
    rng_file = directory / f"rng-rank{rank:05d}.safetensors"
    if not rng_file.is_file():
        raise ValueError(f"{directory}: no RNG state for rank {rank} (written by a run with "
                         "fewer ranks?)")
    flat = load_file(str(directory / "optimizer.safetensors"))
    moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in state["moments"]}
    for key, value in flat.items():
        moment, _, name = key.partition("/")
        moments[moment][name] = value
    engine = EngineState(params=load_file(str(directory / "model.safetensors")),
                         moments=moments, optimizer_step=int(state["optimizer_step"]),
                         param_groups=list(state["param_groups"]))
    return Checkpoint(step=int(state["step"]), engine=engine, extra=state["extra"],
                      rng=load_file(str(rng_file)), python_rng=state["python_rng"])


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
