"""Storage retention: after a refresh commits, the hidden-state shards and training work
directories of RL steps older than the retention window are deleted, and, when asked, their
policy checkpoints (``policies``) and the charts beside their observed acceptance
(``charts``) too.

At H = 4096 a step's shards cost ~32 KiB per token; without retention every step ever
extracted stays. :func:`apply_retention` keeps steps ``[refresh_step - retain_steps + 1,
refresh_step]`` and every step a caller protects (the windows of refreshes that are queued
or running), and deletes the rest.

Invariants:

- Only data goes, never a manifest. A deleted step keeps its ``_manifest.json`` (which files there
  were, their hashes, the lineage), rewritten with ``meta.deleted = {"at", "by_refresh",
  "files", "bytes_freed"}``; the marker is written before any file is deleted, so a crash
  in between leaves a marked step whose leftovers the next pass deletes.
- Readers that need the data refuse a deleted step (:class:`ShardsDeletedError` from
  :func:`~pipeline.capture.shards.read_shards_manifest`); extracting the step again (its
  ``ingest_step`` run) rebuilds it from the tokenized samples, which are kept.
- Training work directories (``<work_root>/step=NNNNNN-<fingerprint>/``: checkpoints for
  resuming, the export) of refresh steps before the cutoff are removed once that step's
  drafter is committed in this storage (its work directory is then only a copy). A refresh
  that failed keeps its directory: it is the point a re-run resumes from.
- Policy checkpoints (``policies/step=NNNNNN/``, one per step: the largest thing Aerie
  stores, a whole model) go only when asked, and only of steps whose shards are committed
  (ingested; a step still waiting to be extracted keeps its policy): extracting a step
  again needs its policy, so a step whose policy went can no longer be extracted. They are
  marked and deleted as shards are; readers of the files refuse them by name
  (:class:`~pipeline.manifest.DeletedByRetention` from :func:`pipeline.verified.committed`),
  while the manifest's metadata (sha256, vocab size, tokenizer fingerprint) still reads,
  so the lineage of drafters trained on them stays whole.
- Observed acceptance (``observed/step=NNNNNN/``) keeps its record, ``acceptance.json``,
  which the drift trigger and the loop chart read; with ``charts`` everything else there
  goes (the loop chart drawn at that step, superseded by every later one).
- Idempotent, and safe beside another pass: a file already gone counts as deleted.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from pipeline.capture.shards import SHARDS_KIND
from pipeline.contracts import MANIFEST_NAME
from pipeline.layout import (
    OBSERVED,
    POLICIES,
    SHARDS,
    committed_steps,
    drafter_prefix,
    observed_key,
    parse_step_dir,
    policy_prefix,
    shards_prefix,
)
from pipeline.manifest import deleted_record, read_manifest, write_manifest
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage

__all__ = ["RetentionReport", "apply_retention", "keep_from"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionReport:
    """What one pass deleted (steps ascending) and what it kept on purpose."""

    refresh_step: int
    keep_from: int  # steps >= this are inside the window
    deleted_steps: tuple[int, ...]
    shard_files_deleted: int
    shard_bytes_freed: int
    work_dirs_deleted: tuple[str, ...]
    work_bytes_freed: int
    protected: tuple[int, ...]  # older steps kept because a queued/running refresh reads them
    policy_steps_deleted: tuple[int, ...] = ()
    policy_bytes_freed: int = 0
    chart_files_deleted: int = 0
    chart_bytes_freed: int = 0
    extracted: tuple[int, ...] = ()  # every step whose shards are committed (deleted too)

    @property
    def bytes_freed(self) -> int:
        return (self.shard_bytes_freed + self.work_bytes_freed + self.policy_bytes_freed
                + self.chart_bytes_freed)


def keep_from(refresh_step: int, retain_steps: int) -> int:
    """The oldest step the window ``retain_steps`` keeps after the refresh at ``refresh_step``."""
    if retain_steps < 1:
        raise ValueError(f"retain_steps must be >= 1, got {retain_steps}")
    return refresh_step - retain_steps + 1


def apply_retention(storage: Storage, refresh_step: int, retain_steps: int, *,
                    protected: Iterable[int] = (), work_root: Path | None = None,
                    policies: bool = False, charts: bool = False,
                    now: datetime | None = None) -> RetentionReport:
    """Delete the shards (and, under ``work_root``, the training work directories; with
    ``policies``, the policy checkpoints of ingested steps; with ``charts``, what lies
    beside their observed acceptance) of steps before ``keep_from(refresh_step,
    retain_steps)`` that are not ``protected``."""
    cutoff = keep_from(refresh_step, retain_steps)
    keep = set(protected)
    at = (now or datetime.now(UTC)).isoformat(timespec="seconds")
    ingested = committed_steps(storage.list(SHARDS), SHARDS)
    old = [s for s in ingested if s < cutoff and s not in keep]
    deleted, files, freed = _delete_steps(storage, old, shards_prefix, SHARDS_KIND,
                                          refresh_step, at)
    dirs, work_freed = (_delete_work_dirs(storage, work_root, cutoff, keep) if work_root
                        else ((), 0))
    gone, policy_freed = (), 0
    if policies:
        extracted = set(ingested)
        old = [s for s in committed_steps(storage.list(POLICIES), POLICIES)
               if s < cutoff and s not in keep and s in extracted]
        gone, _, policy_freed = _delete_steps(storage, old, policy_prefix, POLICY_KIND,
                                              refresh_step, at)
    charted, chart_freed = _delete_charts(storage, cutoff, keep) if charts else (0, 0)
    report = RetentionReport(refresh_step, cutoff, deleted, files, freed, dirs,
                             work_freed, tuple(sorted(s for s in keep if s < cutoff)),
                             gone, policy_freed, charted, chart_freed, tuple(ingested))
    if deleted or dirs or gone or charted:
        log.info("retention after the refresh at step %d: shards of steps %s (%d bytes), "
                 "%d work dir(s) (%d bytes) and the policies of steps %s (%d bytes) deleted",
                 refresh_step, list(deleted), freed, len(dirs), work_freed, list(gone),
                 policy_freed)
    return report


def _delete_charts(storage: Storage, cutoff: int, keep: set[int]) -> tuple[int, int]:
    """Every file of ``observed/step=N/`` but its record, for the old steps."""
    files, freed = 0, 0
    for key in storage.list(OBSERVED):
        step = parse_step_dir(key.split("/")[1]) if key.count("/") >= 2 else None
        if step is None or step >= cutoff or step in keep or key == observed_key(step):
            continue
        size = storage.size(key)
        try:
            storage.delete(key)
        except FileNotFoundError:  # another pass deleted it first
            continue
        files, freed = files + 1, freed + size
    return files, freed


def _delete_steps(storage: Storage, steps: Iterable[int], prefix_of, kind: str,
                  refresh_step: int, at: str) -> tuple[tuple[int, ...], int, int]:
    """(steps whose files went, files deleted, bytes freed) over the datasets of ``steps``."""
    deleted, files, freed = [], 0, 0
    for step in steps:
        n, size = _delete_dataset(storage, prefix_of(step), kind, refresh_step, at)
        if n:
            deleted.append(step)
            files, freed = files + n, freed + size
    return tuple(deleted), files, freed


def _delete_dataset(storage: Storage, prefix: str, kind: str, refresh_step: int, at: str
                    ) -> tuple[int, int]:
    """Mark the dataset deleted (first), then delete every file of it but the manifest."""
    manifest = read_manifest(storage, prefix, kind=kind)
    if manifest is None:
        return 0, 0
    doomed = [k for k in storage.list(prefix) if k != f"{prefix}/{MANIFEST_NAME}"]
    if not doomed:
        return 0, 0
    sizes = {f"{prefix}/{f.path}": f.bytes for f in manifest.files}
    freed = sum(sizes[k] if k in sizes else storage.size(k) for k in doomed)
    if deleted_record(manifest) is None:
        write_manifest(storage, prefix, replace(manifest, meta={
            **manifest.meta, "deleted": {"at": at, "by_refresh": refresh_step,
                                         "files": len(doomed), "bytes_freed": freed}}))
    for key in doomed:
        try:
            storage.delete(key)
        except FileNotFoundError:  # another pass deleted it first: the goal, reached
            log.info("%s: already deleted", storage.url(key))
    return len(doomed), freed


def _delete_work_dirs(storage: Storage, root: Path, cutoff: int, keep: set[int]
                      ) -> tuple[tuple[str, ...], int]:
    if not root.is_dir():
        return (), 0
    gone, freed = [], 0
    for d in sorted(root.iterdir()):
        step = parse_step_dir(d.name.split("-", 1)[0]) if d.is_dir() else None
        if step is None or step >= cutoff or step in keep:
            continue
        if read_manifest(storage, drafter_prefix(step)) is None:
            continue  # not committed here (failed, or another storage's): a resume point
        freed += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        shutil.rmtree(d)
        gone.append(d.name)
    return tuple(gone), freed
