"""The ``drafter_checkpoint`` stage: train a refresh step's drafter and publish it.

``run(storage, step, config)`` reads the vocab stage's choice for ``step`` (window
+ mapping), checks the window's shards, resolves the warm start, runs training in child
process(es) (:mod:`launch`) in a run directory named by the spec's fingerprint (so a retry
resumes), and publishes the exported SGLang directory to ``drafters/step=NNNNNN/`` with a
manifest written last.

Invariants:

- Idempotent: a committed drafter manifest with the same fingerprint (or the fingerprint an
  earlier definition gave the same inputs, :meth:`TrainSpec.superseded`) is returned as is;
  one with another fingerprint is withdrawn before its files are replaced.
- Lineage in the manifest: window steps and the sha256 of each step's shard manifest, vocab
  cache key and coverage, teacher policy, aux layer ids, warm-start source and decision,
  training config and per-depth metrics.
- Warm start ``"serving"`` (the asset's default): the drafter serving now, from the serving
  ledger, when it was trained on an earlier step; ``"previous"``: the newest committed drafter
  of an earlier step, promoted or not; ``"none"``: scratch; otherwise a storage prefix holding
  a drafter manifest or a local drafter directory. A drafter whose shapes do not fit starts
  from scratch (:mod:`warmstart`); the decision is recorded.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.algorithms import algorithm, trained_layers
from pipeline.capture.window import read_window, shard_geometry, verify_window
from pipeline.contracts import Manifest
from pipeline.layout import (
    DRAFTERS,
    drafter_prefix,
    shards_prefix,
    step_dir,
    step_of_prefix,
    steps_of,
)
from pipeline.manifest import (
    entry_for,
    manifest_key,
    read_manifest,
    withdraw_manifest,
    write_manifest,
)
from pipeline.records import to_dict, to_json
from pipeline.serving_now import serving_history
from pipeline.snapshot.policy import load_policy_config, load_policy_ref
from pipeline.storage import Storage, StorageError
from pipeline.training.config import TrainConfig
from pipeline.training.curve import TrainingObserver, display_points, read_curve, write_curve
from pipeline.training.launch import Launcher, launch
from pipeline.training.spec import DRAFTER_CONTENT, TrainResult, TrainSpec, drafter_content_sha256
from pipeline.verified import fetch
from pipeline.vocab.stage import load_window_vocab

log = logging.getLogger(__name__)
DRAFTER_KIND = "drafter_checkpoint"

@dataclass(frozen=True)
class DrafterRefresh:
    """A published drafter and how it was made."""

    step: int
    uri: str
    manifest: Manifest
    result: TrainResult  # its history: at most DISPLAY_POINTS points (the manifest's)
    reused: bool  # an identical drafter was already committed
    curve: list[dict[str, Any]] = field(default_factory=list)  # every step (training_curve)


def previous_drafter(storage: Storage, step: int) -> int | None:
    """The newest step < ``step`` with a committed drafter."""
    steps = [s for s in steps_of(storage.list_dirs(DRAFTERS)) if s < step]
    for s in reversed(steps):
        if read_manifest(storage, drafter_prefix(s)) is not None:
            return s
    return None


def served_drafter(storage: Storage, serving_name: str, step: int) -> int | None:
    """The step of the newest drafter the ledger of ``serving_name`` has served that was
    trained before ``step``: the drafter serving now, except when an older step is re-run
    after later promotions (then the one that served before it, so a re-run plans the same
    warm start). Entries that serve no drafter, or one from outside ``drafters/``, are
    skipped. A candidate the gate refused never served, so it is never a warm start."""
    for manifest in reversed(serving_history(storage, serving_name)):
        if manifest.target is None:
            continue
        try:
            key = storage.key_of(manifest.target.drafter_uri)
        except StorageError as e:  # served from outside this root: not one of drafters/
            log.warning("serving record %d of %s: %s", manifest.sequence, serving_name, e)
            continue
        served = step_of_prefix(key, DRAFTERS)
        if served is not None and served < step:
            return served
    return None


@dataclass(frozen=True)
class WarmStart:
    """A resolved warm start: a local copy, where it came from, and what identifies it."""

    directory: str
    source: str  # storage key or local URI, ``#`` the first 16 hex of its content sha256
    identity: str  # ``sha256:`` + :func:`drafter_content_sha256`: what the fingerprint covers
    superseded: str  # the identity the definition before #39 gave it (see TrainSpec)


def resolve_warm_start(storage: Storage, step: int, warm_start: str,
                       serving_name: str | None = None) -> WarmStart | None:
    """The warm start of ``step``'s refresh, or None (scratch).

    ``warm_start``: ``serving`` (the drafter serving ``serving_name``, see
    :func:`served_drafter`), ``previous`` (the newest committed drafter of an earlier step,
    promoted or not), ``none``, or a committed drafter prefix / local drafter directory.
    """
    if warm_start == "none":
        return None
    if warm_start in ("serving", "previous"):
        if warm_start == "serving" and not serving_name:
            raise ValueError("warm_start 'serving' needs the serving name (the registered "
                             "model)")
        prev = (served_drafter(storage, serving_name, step) if warm_start == "serving"
                else previous_drafter(storage, step))
        if prev is None:
            return None
        warm_start = drafter_prefix(prev)
    manifest = read_manifest(storage, warm_start) if "://" not in warm_start and not \
        warm_start.startswith("/") else None
    if manifest is not None:
        local = fetch(storage, warm_start, label="drafter")  # verified against its manifest
        content = drafter_content_sha256({f.path: f.sha256 for f in manifest.files})
        whole = hashlib.sha256(to_json(manifest).encode()).hexdigest()
        return WarmStart(str(local), f"{warm_start}#{content[:16]}", f"sha256:{content}",
                         f"{warm_start}#{whole[:16]}")  # keys: the same wherever stored
    local = Path(warm_start.removeprefix("file://"))
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"warm start {warm_start!r} is neither a committed drafter in "
                                f"{storage.url()} nor a local drafter directory")
    sha = {name: hashlib.sha256((local / name).read_bytes()).hexdigest()
           for name in DRAFTER_CONTENT if (local / name).is_file()}
    content, uri = drafter_content_sha256(sha), local.resolve().as_uri()
    return WarmStart(str(local), f"{uri}#{content[:16]}", f"sha256:{content}",
                     f"{uri}#{sha['model.safetensors'][:16]}")


def plan(storage: Storage, step: int, config: TrainConfig, work_root: Path,
         warm_start: str = "previous", serving_name: str | None = None) -> TrainSpec:
    """The spec of ``step``'s refresh (reads manifests only)."""
    window, mapping = load_window_vocab(storage, step)
    manifests = read_window(storage, window)  # names any missing step
    shard_sha = {str(s): hashlib.sha256(storage.read_bytes(
        manifest_key(shards_prefix(s)))).hexdigest() for s in window}
    check_drafts_for(storage, step, config, manifests)
    warm = resolve_warm_start(storage, step, warm_start, serving_name)
    spec = TrainSpec(config=config, storage_url=storage.root_url, step=step,
                     window_steps=tuple(window), shard_manifest_sha256=shard_sha,
                     vocab_key=mapping.cache_key, policy_sha256=load_policy_ref(
                         storage, step).sha256, work_dir="", out_dir="",
                     warm_start_dir=warm and warm.directory,
                     warm_start_source=warm and warm.source,
                     warm_start_identity=warm and warm.identity,
                     superseded_identity=warm and warm.superseded)
    return in_work_root(spec, Path(work_root))


def check_drafts_for(storage: Storage, step: int, config: TrainConfig,
                     manifests: Mapping[int, Manifest]) -> None:
    """Refuse, before any training runs, a drafter the algorithm cannot build for ``step``'s
    policy on the window's layers (DFlash for a family no engine captures it for, a RoPE or
    a width it cannot take), naming the reason."""
    target = load_policy_config(storage, step)
    _, captured = shard_geometry(manifests)
    try:
        algorithm(config.drafter_algorithm).new_config(
            target, aux_layer_ids=trained_layers(config.drafter_algorithm, captured, target),
            shape=config.drafter_shape, train=config)
    except ValueError as e:
        raise ValueError(f"step {step}: cannot train a {config.drafter_algorithm} drafter for "
                         f"this policy: {e}") from e


def in_work_root(spec: TrainSpec, work_root: Path) -> TrainSpec:
    """``spec`` with its run directory under ``work_root``, named by its fingerprint."""
    run_dir = work_root / f"{step_dir(spec.step)}-{spec.fingerprint()[:16]}"
    return replace(spec, work_dir=str(run_dir), out_dir=str(run_dir / "export"))


def run(storage: Storage, step: int, config: TrainConfig, *, work_root: Path,
        warm_start: str = "previous", serving_name: str | None = None,
        launcher: str | Launcher = "auto", storage_options: Mapping[str, Any] | None = None,
        on_line: Callable[[str], None] | None = None,
        observer: TrainingObserver | None = None) -> DrafterRefresh:
    """Train, export and publish the drafter of refresh step ``step``; ``observer`` follows
    the training (started, each logged step, failed or committed)."""
    spec = plan(storage, step, config, Path(work_root), warm_start, serving_name)
    prefix = drafter_prefix(step)
    existing = read_manifest(storage, prefix)
    earlier = spec.superseded()
    if (existing is not None and earlier is not None
            and existing.meta.get("fingerprint") == earlier.fingerprint()):
        spec = in_work_root(earlier, Path(work_root))  # committed under the earlier definition
    follow = _Follow(observer)
    if existing is not None and existing.meta.get("fingerprint") == spec.fingerprint():
        log.info("step %d: drafter %s already committed", step, spec.fingerprint()[:12])
        curve = read_curve(storage, prefix, existing)
        follow("committed", spec, curve, lambda: fetch(storage, prefix, kind=DRAFTER_KIND,
                                                       label="drafter"))
        return DrafterRefresh(step, storage.url(prefix), existing,
                              TrainResult(**existing.meta["result"]), reused=True, curve=curve)
    verify_window(storage, read_window(storage, spec.window_steps))
    follow("started", spec)
    try:
        result = launch(spec, launcher=launcher, storage_options=storage_options,
                        cache={"dir": str(storage.cache_dir),
                               "max_bytes": storage.cache_max_bytes},
                        on_line=on_line, on_metrics=lambda e: follow("logged", e))
        manifest = _publish(storage, step, spec, config, result, existing)
    except BaseException:
        follow("failed")
        raise
    follow("committed", spec, result.history, lambda: Path(spec.out_dir))
    return DrafterRefresh(step, storage.url(prefix), manifest,
                          TrainResult(**manifest.meta["result"]), reused=False,
                          curve=result.history)


class _Follow:
    """Calls to the observer, best effort: tracking (an MLflow server) going away never
    stops or fails a training, nor hides its error. A call that fails is logged, and the
    observer is not called again in this run; registration logs whatever it missed."""

    def __init__(self, observer: TrainingObserver | None):
        self.observer = observer

    def __call__(self, method: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception as e:  # noqa: BLE001 - tracking is best effort, see the docstring
            log.warning("training tracking failed in %s (%s: %s); training goes on without "
                        "it", method, type(e).__name__, e)
            self.observer = None


def _publish(storage: Storage, step: int, spec: TrainSpec, config: TrainConfig,
             result: TrainResult, existing: Manifest | None) -> Manifest:
    """Upload the export and the whole training curve; the manifest (written last) keeps
    the lineage and at most DISPLAY_POINTS points of the curve."""
    prefix = drafter_prefix(step)
    if existing is not None:
        log.warning("step %d: replacing a drafter trained from other inputs", step)
    withdraw_manifest(storage, prefix)
    written = storage.upload_dir(spec.out_dir, prefix)
    written.append(write_curve(storage, prefix, result.history))
    manifests = read_window(storage, spec.window_steps)
    _, aux_ids = shard_geometry(manifests)
    _, mapping = load_window_vocab(storage, step)
    # the record keeps no path of this host: the manifest lists the files themselves
    compact = replace(result, history=display_points(result.history), out_dir="")
    manifest = Manifest(kind=DRAFTER_KIND, kind_version=1,
                        files=tuple(entry_for(prefix, w) for w in written), meta={
                            "step": step, "fingerprint": spec.fingerprint(),
                            "window_steps": list(spec.window_steps),
                            "shard_manifest_sha256": spec.shard_manifest_sha256,
                            "vocab_cache_key": spec.vocab_key, "coverage": mapping.coverage,
                            "draft_vocab_size": mapping.draft_vocab_size,
                            "policy_sha256": spec.policy_sha256,
                            "aux_layer_ids": list(aux_ids),
                            "warm_start": result.warm_start,
                            "config": to_dict(config), "result": asdict(compact)})
    write_manifest(storage, prefix, manifest)
    return manifest
