"""Following an RL framework's dump directory into snapshots: :class:`Ingestor`.

A :class:`DumpReader` knows one framework's files: which step each holds, when one is
complete, and how to turn it into snapshot records. The ingestor writes every complete,
not yet committed step through :class:`~pipeline.snapshot.writer.SnapshotWriter`, with the
checkpoint of the policy that generated it (:func:`~.checkpoints.policy_checkpoint`).

Nothing is skipped silently. A bad record is quarantined by the writer like any other; a
file that cannot be read as a whole (not JSON, a pickle where plain data was promised, a
field of the wrong shape) is copied to ``ingest/quarantine/<framework>/<file>`` with
``<file>.reason.json`` (field, reason, sha256) beside it and reported on every pass until
the file changes. A step is done once its snapshot is committed, so an interrupted ingest
resumes where it stopped and a committed step is never rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline.adapters.checkpoints import policy_checkpoint
from pipeline.layout import raw_prefix
from pipeline.manifest import manifest_key
from pipeline.sampling import SamplingParams
from pipeline.snapshot.sieve import SnapshotSummary
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

log = logging.getLogger(__name__)

QUARANTINE = "ingest/quarantine"


class DumpError(ValueError):
    """A dump file that cannot be read as a whole; ``field`` names what is wrong in it."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class StepFile:
    """One file of a dump directory and the trainer step it holds."""

    step: int
    path: Path


@dataclass(frozen=True)
class StepRecords:
    """A dump file read: its snapshot records and the version of the policy that generated
    them (the checkpoint the snapshot publishes)."""

    records: list[dict[str, Any]]
    policy_version: int
    sampling: dict[str, Any] | None = None


class DumpReader(Protocol):
    """One framework's dump files."""

    framework: str
    checkpoint_pattern: str  # where its HF checkpoints are, relative to the checkpoint root

    def checkpoint_root(self, directory: Path) -> Path:
        """Where the checkpoints are when the user does not say (the dump's neighbours)."""

    def step_files(self, directory: Path) -> list[StepFile]:
        """The step files under ``directory``, ascending by step."""

    def read(self, file: StepFile, context: ReadContext) -> StepRecords:
        """The records of ``file``, or :class:`DumpError`."""


@dataclass
class ReadContext:
    """What a reader may need beyond the file: the policy's tokenizer (loaded on first use,
    from the initial policy dir) and the user's opt-ins."""

    tokenizer_dir: Path
    allow_multi_turn_text: bool = False
    _tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        return self._tokenizer


@dataclass
class IngestReport:
    """One pass: the steps written and the files quarantined (new or still so)."""

    written: list[SnapshotSummary] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)  # file name -> reason
    waiting: list[str] = field(default_factory=list)  # files not complete yet

    def to_dict(self) -> dict[str, Any]:
        return {"written": [s.step for s in self.written],
                "records": sum(s.accepted for s in self.written),
                "records_quarantined": sum(s.quarantined for s in self.written),
                "files_quarantined": self.quarantined, "waiting": self.waiting}


@dataclass
class Ingestor:
    """Writes the complete, uncommitted steps of ``directory`` (a ``reader`` dump) as
    snapshots. Checkpoints are found under ``checkpoints`` with the reader's pattern (or
    ``pattern``); the initial policy (version 0, and the tokenizer) is ``initial_policy``.
    A file is complete once a later step's file exists or it has not changed for
    ``settle_s`` seconds (the framework may still be writing the newest one)."""

    storage: Storage
    reader: DumpReader
    directory: Path
    initial_policy: Path
    checkpoints: Path | None = None
    pattern: str | None = None
    sampling: dict[str, Any] | None = None
    settle_s: float = 60.0
    allow_multi_turn_text: bool = False

    def __post_init__(self) -> None:
        self.directory, self.initial_policy = Path(self.directory), Path(self.initial_policy)
        if self.sampling is not None:
            SamplingParams.from_mapping(self.sampling)  # refuse a bad setting before any work
        self.writer = SnapshotWriter(self.storage)
        self.context = ReadContext(self.initial_policy, self.allow_multi_turn_text)

    def run_once(self) -> IngestReport:
        report = IngestReport()
        files = self.reader.step_files(self.directory)
        for i, file in enumerate(files):
            if self.storage.exists(manifest_key(raw_prefix(file.step))):
                continue
            if i == len(files) - 1 and time.time() - file.path.stat().st_mtime < self.settle_s:
                report.waiting.append(file.path.name)
                continue
            reason = self._quarantined(file)
            if reason is not None:
                report.quarantined[file.path.name] = reason
                continue
            try:
                step = self.reader.read(file, self.context)
            except DumpError as e:
                report.quarantined[file.path.name] = self._quarantine(file, e)
                continue
            report.written.append(self._write(file, step))
        return report

    def _write(self, file: StepFile, step: StepRecords) -> SnapshotSummary:
        checkpoint = policy_checkpoint(
            self.checkpoints or self.reader.checkpoint_root(self.directory),
            self.pattern or self.reader.checkpoint_pattern, step.policy_version,
            self.initial_policy, shift=getattr(self.reader, "checkpoint_shift", 0))
        if checkpoint.version != step.policy_version:
            log.warning("%s step %d: generated by policy %d, whose checkpoint was not saved; "
                        "publishing the newest saved before it (%s, version %d)",
                        self.reader.framework, file.step, step.policy_version,
                        checkpoint.path, checkpoint.version)
        summary = self.writer.write_step(file.step, step.records, checkpoint.path,
                                         checkpoint.version,
                                         sampling=self.sampling or step.sampling)
        log.info("%s step %d: %d records from %s (policy %s)", self.reader.framework,
                 file.step, summary.accepted, file.path.name, checkpoint.path)
        return summary

    def _reason_key(self, file: StepFile) -> str:
        return f"{QUARANTINE}/{self.reader.framework}/{file.path.name}.reason.json"

    def _quarantined(self, file: StepFile) -> str | None:
        """The reason ``file`` is in quarantine, unless it changed since."""
        key = self._reason_key(file)
        if not self.storage.exists(key):
            return None
        kept = json.loads(self.storage.read_bytes(key))
        return f"{kept['field']}: {kept['reason']}" if kept["sha256"] == _sha256(file.path) \
            else None

    def _quarantine(self, file: StepFile, error: DumpError) -> str:
        prefix = f"{QUARANTINE}/{self.reader.framework}"
        self.storage.upload_file(file.path, f"{prefix}/{file.path.name}")
        reason = f"{error.field}: {error.reason}"
        self.storage.write_bytes(self._reason_key(file), json.dumps({
            "file": str(file.path), "step": file.step, "field": error.field,
            "reason": error.reason, "sha256": _sha256(file.path)}, indent=1).encode())
        log.warning("%s: quarantined (%s)", file.path, reason)
        return reason


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def step_files(directory: Path, shape: re.Pattern[str]) -> list[StepFile]:
    """The files of ``directory`` whose name ``shape`` matches (group 1: the step), by step."""
    found = [StepFile(int(m.group(1)), p) for p in Path(directory).iterdir()
             if (m := shape.fullmatch(p.name)) and p.is_file()]
    return sorted(found, key=lambda f: f.step)


def number(value: Any, where: str) -> float | None:
    """A JSON number (None stays None), else :class:`DumpError` naming ``where``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DumpError(where, f"expected a number, got {type(value).__name__}")
    return float(value)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file, or :class:`DumpError` naming the line."""
    out = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DumpError(f"line {n}", f"not JSON: {e.msg} at column {e.colno}") \
                        from None
                if not isinstance(obj, dict):
                    raise DumpError(f"line {n}", f"expected an object, got "
                                                 f"{type(obj).__name__}")
                out.append(obj)
        except UnicodeDecodeError as e:
            raise DumpError("<file>", f"invalid UTF-8 at byte {e.start}") from None
    return out
