"""The drafter serving now: the serving record, and how every stage reads it.

A :class:`ServingManifest` says which drafter the rollout servers of one model run and with
which SGLang arguments. Release writes one per change (:mod:`pipeline.release.ledger`:
``serving/<name>/manifest-NNNNNN.json`` + ``current.json``); it is the one record of "the
drafter serving now": training's warm start (:func:`serving_history`), evaluation's champion
(:func:`serving_drafter_key`), promotion's champion and the RL trainer's rollout launcher at
weight sync (:func:`resolve_serving`) all read it. It lives in the foundation so that earlier
stages read it without importing the release stage.

Invariants:

- The record is stdlib only, frozen, JSON round-trip with ``SCHEMA_VERSION``; a reader
  refuses a manifest written by a newer schema.
- The settings are :class:`~pipeline.eagle3.spec.SpecParams`, the same record (and
  SGLang rules) acceptance evaluation measures with, as the drafter's algorithm serves it
  (``algorithm``; a DFlash drafter's settings are its block's chain); the flags are that
  algorithm's (:mod:`pipeline.algorithms`). Version-1 manifests (before the field) served
  EAGLE-3 and are read so.
- ``sglang_args`` hold the literal placeholder ``{drafter_dir}`` for the draft-model path:
  where the drafter lands is decided by whoever launches the server
  (:func:`ServingManifest.launch_args`).
- A manifest may carry a :class:`Canary`: a candidate that some of the rollout servers serve
  while the rest serve ``target`` (the champion). :meth:`ServingManifest.on` is what one
  server serves; every reader that launches one server asks it. Such a manifest is written
  with schema 3, which older readers refuse rather than serve the champion everywhere; one
  without a canary stays schema 2.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.algorithms import DEFAULT_ALGORITHM
from pipeline.algorithms import algorithm as drafter_algorithm
from pipeline.eagle3.spec import SpecParams
from pipeline.layout import serving_prefix
from pipeline.manifest import manifest_key
from pipeline.records import from_json
from pipeline.storage import Storage
from pipeline.verified import DEFAULT_CACHE_BYTES, DatasetCache, IntegrityError, committed

SERVING_SCHEMA_VERSION = 2  # 2: the drafter's algorithm (1 served EAGLE-3 only)
CANARY_SCHEMA_VERSION = 3  # 3: a canary on part of the servers
DRAFTER_DIR = "{drafter_dir}"


def serving_args(settings: SpecParams, drafter_dir: str = DRAFTER_DIR,
                 algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, ...]:
    """SGLang's flags that serve an ``algorithm`` drafter from ``drafter_dir``."""
    return drafter_algorithm(algorithm).sglang_args(settings, drafter_dir)


def vllm_speculative_config(settings: SpecParams, drafter_dir: str,
                            algorithm: str = DEFAULT_ALGORITHM) -> str:
    """vLLM's ``--speculative-config`` JSON for an ``algorithm`` drafter in ``drafter_dir``."""
    return drafter_algorithm(algorithm).vllm_speculative_config(settings, drafter_dir)


ENGINES = ("sglang", "vllm", "trl-vllm-serve", "nemo-rl", "verl")
_HYDRA_KEYS = {  # where a trainer's config passes vLLM its speculative_config
    "nemo-rl": "policy.generation.vllm_kwargs.speculative_config",
    "verl": "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config",
}


def engine_args(engine: str, settings: SpecParams, drafter_dir: str,
                algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, ...]:
    """The launch flags that serve the ``algorithm`` drafter in ``drafter_dir`` on
    ``engine``: SGLang's ``launch_server``, ``vllm serve``, TRL's ``trl vllm-serve`` (which
    forwards its ``--speculative_config`` to vLLM), or the config overrides of NeMo-RL (its
    vLLM workers pass ``policy.generation.vllm_kwargs`` to the engine) or verl (its vLLM
    servers take ``rollout.engine_kwargs.vllm`` as engine arguments)."""
    if engine == "sglang":
        return serving_args(settings, drafter_dir, algorithm)
    if engine not in ("vllm", "trl-vllm-serve", *_HYDRA_KEYS):
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    config = vllm_speculative_config(settings, drafter_dir, algorithm)
    if engine == "vllm":
        return ("--speculative-config", config)
    if engine == "trl-vllm-serve":
        return ("--speculative_config", config)
    return tuple(f"++{_HYDRA_KEYS[engine]}.{k}={v}" for k, v in json.loads(config).items())


def drafter_name(version: str | None, fingerprint: str | None) -> str:
    """Aerie's one way of naming a drafter: registry version and short fingerprint,
    ``v3 (0123abcd)``; "none" for no drafter."""
    if version is None or version == "none":
        return "none"
    return f"v{version} ({(fingerprint or '?')[:8]})"


@dataclass(frozen=True)
class ServingTarget:
    """A drafter to serve: where its files are and which registry version it is."""

    drafter_uri: str  # storage key of the drafter directory (Storage.key_of also reads the
    # full URLs older releases recorded)
    fingerprint: str
    registry_model: str
    registry_version: str
    registry_source: str | None = None  # the same files in MLflow: models:/<model>/<version>
    # (older records: the artifact URI of that time)

    @property
    def name(self) -> str:
        return drafter_name(self.registry_version, self.fingerprint)


@dataclass(frozen=True)
class Canary:
    """A candidate serving part of the rollout servers, beside the manifest's champion.

    ``servers`` names them; empty, a ``share`` of whichever servers a reader launches
    (:func:`canary_servers`). ``started_at``: the first RL step whose rollouts may carry it
    (the canary is judged on the steps from there on)."""

    target: ServingTarget
    settings: SpecParams
    sglang_args: tuple[str, ...]
    algorithm: str
    started_at: int
    servers: tuple[str, ...] = ()
    share: float = 0.0

    def __post_init__(self) -> None:
        if not self.servers and not 0 < self.share < 1:
            raise ValueError("a canary needs its servers or a share between 0 and 1")


def canary_servers(canary: Canary, fleet: Sequence[str]) -> tuple[str, ...]:
    """The servers of ``fleet`` that serve ``canary``: the ones it names, or the first
    ``share`` of them in sorted order (at least one, never all: the champion keeps one)."""
    if canary.servers:
        return tuple(s for s in fleet if s in canary.servers)
    ordered = sorted(set(fleet))
    if len(ordered) < 2:
        return ()
    count = min(len(ordered) - 1, max(1, round(canary.share * len(ordered))))
    return tuple(ordered[:count])


@dataclass(frozen=True)
class ServingManifest:
    """What the servers of ``name`` run, as of manifest number ``sequence``.

    ``target`` None means "serve without a drafter" (e.g. the restore of a first promotion).
    ``previous_sequence`` is the manifest this one replaced; ``restored_from`` the one whose
    drafter it restores (a rollback or the undo of a failed promotion).
    """

    name: str
    sequence: int
    mode: str
    target: ServingTarget | None
    settings: SpecParams
    sglang_args: tuple[str, ...]
    written_at: str
    reason: str = ""
    previous_sequence: int | None = None
    restored_from: int | None = None
    details: dict[str, str] = field(default_factory=dict, hash=False)
    algorithm: str = DEFAULT_ALGORITHM  # the drafter's (pipeline.algorithms), whose flags
    # sglang_args are and whose settings ``settings`` are
    canary: Canary | None = None  # a candidate on part of the servers
    schema_version: int = SERVING_SCHEMA_VERSION
    READABLE_SCHEMA_VERSIONS = (1, SERVING_SCHEMA_VERSION, CANARY_SCHEMA_VERSION)

    def launch_args(self, drafter_dir: str) -> list[str]:
        """The SGLang arguments with the local drafter directory filled in ([] without one)."""
        return [drafter_dir if a == DRAFTER_DIR else a for a in self.sglang_args]

    def on(self, server: str, fleet: Sequence[str]) -> ServingManifest:
        """What ``server`` of the rollout servers ``fleet`` serves: this manifest as one
        server sees it, without a canary (the canary's drafter where it serves it)."""
        if self.canary is None:
            return self
        c = self.canary
        if server in canary_servers(c, fleet):
            return replace(self, target=c.target, settings=c.settings,
                           sglang_args=c.sglang_args, algorithm=c.algorithm, canary=None)
        return replace(self, canary=None)


# -- reading the ledger (release writes it: pipeline.release.ledger) -------------------------
CURRENT = "current.json"
_ENTRY = re.compile(r"^manifest-(\d{6,})\.json$")


def current_key(name: str) -> str:
    return f"{serving_prefix(name)}/{CURRENT}"


def entry_key(name: str, sequence: int) -> str:
    return f"{serving_prefix(name)}/manifest-{sequence:06d}.json"


def serving_sequences(storage: Storage, name: str) -> list[int]:
    found = (_ENTRY.match(k.rsplit("/", 1)[-1]) for k in storage.list(serving_prefix(name)))
    return sorted(int(m.group(1)) for m in found if m)


def read_serving_entry(storage: Storage, name: str, sequence: int) -> ServingManifest:
    return from_json(ServingManifest, storage.read_bytes(entry_key(name, sequence)).decode())


def serving_history(storage: Storage, name: str) -> list[ServingManifest]:
    """Every serving manifest of ``name``, oldest first."""
    return [read_serving_entry(storage, name, s) for s in serving_sequences(storage, name)]


def serving_drafter_key(storage: Storage, name: str) -> str | None:
    """Storage key of the drafter serving ``name`` now, or None (nothing served, or serving
    without a drafter). A drafter outside this storage root is a :class:`StorageError`."""
    manifest = read_serving(storage, name)
    if manifest is None or manifest.target is None:
        return None
    return storage.key_of(manifest.target.drafter_uri)


def read_serving(storage: Storage, name: str) -> ServingManifest | None:
    """The current serving manifest of ``name``, or None if nothing was ever published."""
    key = current_key(name)
    try:
        data = storage.read_bytes(key)
    except FileNotFoundError:
        return None
    manifest = from_json(ServingManifest, data)
    try:  # current.json is a copy of the immutable manifest-N.json it names
        copied = storage.read_bytes(entry_key(name, manifest.sequence))
    except FileNotFoundError:
        copied = None
    if copied != data:
        raise IntegrityError(f"{storage.url(key)}: differs from "
                             f"{storage.url(entry_key(name, manifest.sequence))}, the record "
                             f"it must copy")
    return manifest


@dataclass(frozen=True)
class ServingLaunch:
    """What a rollout launcher needs: the manifest, the local drafter and SGLang's args."""

    manifest: ServingManifest
    drafter_dir: Path | None
    args: tuple[str, ...]

    def args_for(self, engine: str) -> tuple[str, ...]:
        """The launch flags for ``engine`` (:data:`ENGINES`); () when serving no drafter."""
        if self.drafter_dir is None:
            return ()
        return engine_args(engine, self.manifest.settings, str(self.drafter_dir),
                           self.manifest.algorithm)


def resolve_serving(storage: Storage, name: str, cache_dir: str | Path,
                    known_sequence: int | None = None, *, server: str | None = None,
                    fleet: Sequence[str] = ()) -> ServingLaunch | None:
    """For the RL trainer at weight sync: the current manifest with its drafter on local
    disk and the SGLang arguments filled in. None when nothing was published, or when the
    current manifest is ``known_sequence`` (nothing changed since the last sync).
    ``server`` of the rollout servers ``fleet``: what that one serves (a canary's drafter
    where it serves one); without it, the champion."""
    manifest = read_serving(storage, name)
    if manifest is None or manifest.sequence == known_sequence:
        return None
    return launch_of(storage, manifest.on(server, fleet) if server else
                     replace(manifest, canary=None), cache_dir)


def launch_of(storage: Storage, manifest: ServingManifest, cache_dir: str | Path
              ) -> ServingLaunch:
    """``manifest`` with its drafter fetched (and verified) into ``cache_dir``."""
    if manifest.target is None:
        return ServingLaunch(manifest, None, ())
    local = materialize_drafter(storage, manifest.target.drafter_uri, cache_dir,
                                fingerprint=manifest.target.fingerprint)
    return ServingLaunch(manifest, local, tuple(manifest.launch_args(str(local))))


def materialize_drafter(storage: Storage, drafter_uri: str, cache_dir: str | Path,
                        max_bytes: int | None = None, *, fingerprint: str | None = None,
                        ) -> Path:
    """A local directory holding the drafter at ``drafter_uri`` (under ``storage``'s root),
    from the dataset cache in ``cache_dir``: every file verified against the drafter's
    manifest (:class:`~pipeline.verified.IntegrityError` naming the file otherwise).

    ``fingerprint``: the one the serving record names; a drafter committed at the same key
    since (a re-trained step) is refused rather than served under the old record."""
    key = storage.key_of(drafter_uri)
    manifest = committed(storage, key)
    if fingerprint is not None and manifest.meta.get("fingerprint") != fingerprint:
        raise IntegrityError(f"{storage.url(manifest_key(key))}: drafter fingerprint "
                             f"{manifest.meta.get('fingerprint')!r}, the serving record "
                             f"names {fingerprint!r}")
    cache = DatasetCache(Path(cache_dir), max_bytes or DEFAULT_CACHE_BYTES)
    return cache.fetch(storage, key, manifest, label="drafter")
