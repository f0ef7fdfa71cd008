"""Data-parallel extraction of one step: N processes, shard ``i`` written by process ``i % N``.

The calling process is part 0 and uses the backend it has already opened; parts 1..N-1 are
child processes (``python -m pipeline.capture.parallel``) that open their own backend from
the same policy checkpoint, one GPU each when the device is ``cuda``/``auto`` (part ``k`` on
``cuda:k mod count``), or a share of the CPU cores each on the CPU.

- **Same bytes as one process.** Every part cuts the same shards (``capture.plan``) and
  must reproduce the run fingerprint :func:`pipeline.capture.stage.start` fixed, so a part
  with another backend, dtype or input refuses to start; shard ``i``'s bytes do not depend
  on which process wrote it.
- **Committed once.** Parts write shards and progress markers only. When every part has
  finished, the caller runs :func:`pipeline.capture.stage.run` with a backend that cannot
  capture: it finds each shard finished (marker and size: the parts have just written
  them, so they are not downloaded again to be hashed) and writes the manifest.
- **Resumable.** A failed child fails the call (:class:`PartFailed`, naming each part and
  its error, retried or not as that error would be) once the other parts have ended; if
  this process's own part fails, the children are stopped. Either way nothing is
  committed and the next call keeps every finished shard.

A child reads its job as one JSON line on stdin (storage options may hold credentials:
never on a command line) and answers one JSON line on stdout. It exits when the parent's
end of stdin closes, so a killed parent leaves no workers behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from pipeline.capture import stage
from pipeline.capture.base import CaptureBackend
from pipeline.capture.config import ExtractConfig
from pipeline.capture.stage import ExtractionError, ExtractSummary, Part, PartSummary
from pipeline.snapshot.policy import PolicyRef
from pipeline.storage import Storage

log = logging.getLogger(__name__)

WORKER_COMMAND = (sys.executable, "-m", "pipeline.capture.parallel")


@dataclass(frozen=True)
class PartFailure:
    """One part that failed: its message, and its error's class names (most derived
    first; empty when the child died without answering, e.g. killed for memory)."""

    part: int
    message: str
    error_types: tuple[str, ...] = ()


class PartFailed(RuntimeError):
    """Parts of a data-parallel extraction failed; nothing was committed. Whether another
    attempt can help is the parts' errors' business (``assets.retry.is_permanent``)."""

    def __init__(self, step: int, failures: Sequence[PartFailure]):
        self.failures = tuple(failures)
        super().__init__(f"step {step}: " + "; ".join(f.message for f in failures)
                         + "; finished shards are kept for the next run")


class _NoCapture:
    """The commit pass's backend: every shard must be there already."""

    def __init__(self, backend: CaptureBackend):
        self._backend = backend
        self.hidden_size, self.aux_layer_ids = backend.hidden_size, backend.aux_layer_ids

    def __getattr__(self, name: str) -> Any:  # describe(), provenance(), name
        return getattr(self._backend, name)

    def capture(self, batch: Sequence[Sequence[int]]) -> list:
        raise ExtractionError("a shard was not written by the part that owns it, though every "
                              "part reported success")


@dataclass(frozen=True)
class PartJob:
    """Everything a child process needs for its part, as JSON."""

    storage: dict[str, Any] = field(repr=False)  # Storage.spec(): may hold credentials
    step: int
    open_args: dict[str, Any] = field(repr=False)  # open_backend's keyword arguments
    # (``kind`` included, JSON: options as a dict; an engine's API key may be among them)
    config: dict[str, Any]
    policy: dict[str, Any] | None
    part: int
    of: int
    fingerprint: str
    threads: int  # torch CPU threads; 0: leave torch's default


def run(storage: Storage, step: int, backend: CaptureBackend, config: ExtractConfig, *,
        processes: int, open_args: Mapping[str, Any], policy: PolicyRef | None = None,
        command: Sequence[str] = WORKER_COMMAND) -> ExtractSummary:
    """Extract ``step`` with ``processes`` processes (1: in this one, as ``stage.run``).

    ``backend`` is this process's, opened with ``open_args`` (``open_backend``'s keyword
    arguments); the children open theirs with the same arguments, their device spread
    over the GPUs when it is ``cuda`` or ``auto``.
    """
    started = time.perf_counter()
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if processes == 1:
        return stage.run(storage, step, backend, config, policy=policy)
    begun = stage.start(storage, step, backend, config, policy=policy)
    if isinstance(begun, ExtractSummary):
        return begun
    processes = min(processes, begun.shards)  # a part owning no shard would only load
    if processes <= 1:                        # the policy
        return stage.run(storage, step, backend, config, policy=policy)
    on_cpu = _device_type(open_args) == "cpu"
    threads = max(1, _cores() // processes) if on_cpu else 0
    jobs = [PartJob(storage.spec(), step, _spread(open_args, k), asdict(config),
                    asdict(policy) if policy else None, k, processes, begun.fingerprint,
                    threads)
            for k in range(1, processes)]
    log.info("step %d: extracting in %d processes (%s)", step, processes,
             f"{threads} CPU threads each" if on_cpu else "one device each")
    with _children(command, jobs) as children:
        with _torch_threads(threads):
            mine = stage.run_part(storage, step, backend, config, Part(0, processes),
                                  begun.fingerprint, policy=policy)
        parts = [mine, *_results(children)]
    summary = stage.run(storage, step, _NoCapture(backend), config, policy=policy,
                        parts_finished=True)
    return replace(summary, backend_calls=sum(p.backend_calls for p in parts),
                   shards_reused=sum(p.shards_kept for p in parts), processes=processes,
                   seconds=time.perf_counter() - started)


def _hf_device(open_args: Mapping[str, Any]) -> str | None:
    """The device an ``hf`` backend runs on; None for the engine backends."""
    if open_args.get("kind", "hf") != "hf":
        return None
    return str((open_args.get("options") or {}).get("device", "cpu"))


def _device_type(open_args: Mapping[str, Any]) -> str:
    device = _hf_device(open_args) or "cpu"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _spread(open_args: Mapping[str, Any], part: int) -> dict[str, Any]:
    """Part ``part``'s backend arguments: ``cuda``/``auto`` on a GPU machine becomes
    ``cuda:part mod count``; an explicit ``cuda:N`` or ``cpu`` stays as it is."""
    args = dict(open_args)
    if _hf_device(args) in ("cuda", "auto") and torch.cuda.is_available():
        args["options"] = {**args["options"],
                           "device": f"cuda:{part % torch.cuda.device_count()}"}
    return args


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _children(command: Sequence[str], jobs: Sequence[PartJob]
              ) -> Iterator[list[tuple[PartJob, subprocess.Popen]]]:
    """Start one child per job; on the way out, any child still running is stopped."""
    children: list[tuple[PartJob, subprocess.Popen]] = []
    try:
        for job in jobs:
            child = subprocess.Popen(list(command), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            children.append((job, child))
            child.stdin.write(json.dumps(asdict(job)) + "\n")
            child.stdin.flush()
        yield children
    finally:
        for _, child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout):
                stream.close()


def _results(children: Sequence[tuple[PartJob, subprocess.Popen]]) -> list[PartSummary]:
    """Each child's summary, after all have ended; failed parts are a :class:`PartFailed`
    naming each (its traceback is on the run's stderr)."""
    answers = [(job, child.stdout.read(), child.wait()) for job, child in children]
    failures = []
    summaries = []
    for job, out, code in answers:
        answer = _answer(out)
        if code == 0 and "part" in answer:
            summaries.append(PartSummary(Part(**answer["part"]), answer["shards_written"],
                                         answer["shards_kept"], answer["backend_calls"]))
        else:
            failures.append(PartFailure(
                job.part, f"part {job.part} of {job.of} exited with status {code}: "
                          f"{answer.get('error', 'no answer (see its stderr)')}",
                tuple(answer.get("error_types", ()))))
    if failures:
        raise PartFailed(children[0][0].step, failures)
    return summaries


def _answer(out: str) -> dict[str, Any]:
    lines = out.strip().splitlines()
    if not lines:
        return {}
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        return {"error": f"unreadable answer {lines[-1][:200]!r}"}
    return answer if isinstance(answer, dict) else {"error": f"unreadable answer {answer!r}"}


# -- the child ------------------------------------------------------------------------------
def _part(job: PartJob) -> PartSummary:
    from pipeline.capture.backends import open_backend

    if job.threads:
        torch.set_num_threads(job.threads)
    storage = Storage.from_spec(job.storage)
    policy = PolicyRef(**job.policy) if job.policy else None
    with open_backend(storage, job.step, **job.open_args) as backend:
        return stage.run_part(storage, job.step, backend, ExtractConfig(**job.config),
                              Part(job.part, job.of), job.fingerprint, policy=policy)


def _exit_when_parent_goes() -> None:
    sys.stdin.read()  # returns at EOF: the parent ended or closed our stdin
    os._exit(3)


def main() -> int:
    answer = os.fdopen(os.dup(1), "w")  # the answer's channel; all other output to stderr
    os.dup2(2, 1)
    job = PartJob(**json.loads(sys.stdin.readline()))
    threading.Thread(target=_exit_when_parent_goes, daemon=True).start()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s part {job.part}/{job.of} %(name)s: %(message)s")
    try:
        summary = _part(job)
    except Exception as e:  # reported to the parent, which fails the run with it
        traceback.print_exc()
        types = [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__]
        _answer_with(answer, {"error": f"{type(e).__name__}: {e}", "error_types": types})
        return 1
    _answer_with(answer, asdict(summary))
    return 0


def _answer_with(channel: Any, value: dict[str, Any]) -> None:
    channel.write(json.dumps(value) + "\n")
    channel.flush()


if __name__ == "__main__":
    sys.exit(main())
