"""The drafter registry: one MLflow registered model per target family, versions with lineage.

:class:`DrafterRegistry` wraps an ``MlflowClient`` (tracking + model registry; an embedded
sqlite database or a server URL) and knows Aerie's conventions:

- one experiment and one registered model per target family, both named
  :func:`model_name` (``aerie-drafter-<family>``);
- a training run (:mod:`pipeline.release.mlflow_runs`, ``registry.runs``) holds params,
  per-step training metrics, evaluation metrics, PNG charts and the drafter directory;
- a version is created with ``create_model_version`` pointing at the run's ``drafter/``
  artifact directory (MLflow 3's ``register_model`` wants a LoggedModel; a plain directory
  is what SGLang loads), with the lineage tags of :mod:`pipeline.release.lineage`;
- aliases, not stages: ``challenger`` marks the newest registered version, ``champion`` the
  one being served (moved only by :mod:`pipeline.release.promotion`);
- a version shows a few tags: the headline of its lineage (fingerprint, algorithm, RL step,
  τ rounded) and the rest of it as one ``lineage`` JSON tag
  (:func:`~pipeline.release.lineage.version_tags`); its training run holds every key;
- decisions about a version (the gate's, a manual override's) are tags too: decision ``n``
  as one JSON tag ``gate.<n>`` (:meth:`DrafterRegistry.record_decision`), and its standing,
  the decision that counts, as ``gate.decision`` with ``gate.decision_id`` = n
  (:meth:`DrafterRegistry.set_standing`; the records: :mod:`pipeline.release.decisions`).
  Versions registered before this layout keep one tag per field (``gate.<n>.decision``, …,
  and one tag per lineage key); both are read.

Invariants:

- Idempotent: registering a drafter whose ``fingerprint`` tag already exists returns that
  version (no duplicate); a finished run with the same fingerprint is reused rather than
  logged again. The lineage tags are passed to ``create_model_version`` itself, so a
  version never exists without them.
- Every tag value is a string; alias reads go to the server (no caching), because alias
  moves are last-writer-wins and promotion must read them back.
- A decision's ``gate.<n>`` tag is written once and never rewritten (n is the next free
  number, taken under the promotion lock); a standing ``promoted`` or ``forced`` is never
  replaced by a ``refused`` one, so the champion's ``gate.decision`` cannot turn ``refused``.
- ``mlflow`` is imported only inside :meth:`DrafterRegistry.connect`; this module never
  reads the environment (MLflow itself reads credentials such as ``MLFLOW_TRACKING_TOKEN``
  or ``AWS_*``).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.algorithms import ALGORITHMS
from pipeline.release.decisions import (
    CANARY,
    FORCED,
    LEGACY_STANDING,
    PROMOTED,
    REFUSED,
    STANDING,
    STANDING_ID,
    DecisionRecord,
    decision_in,
    decision_numbers,
)
from pipeline.release.lease import PostgresLease, fenced, redacted
from pipeline.release.lineage import (
    DRAFTER_URI,
    FINGERPRINT,
    lineage_tags,
    read_lineage,
    tag_value,
    version_tags,
)
from pipeline.release.lock import FileLock, ProcessLock
from pipeline.release.mlflow_runs import TrainingRuns, check_fingerprint, error_code

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
_FAMILY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
_CLIENT_WRITES = ("create_registered_model", "create_model_version", "update_model_version",
                  "set_model_version_tag", "delete_model_version_tag",
                  "set_registered_model_alias", "delete_registered_model_alias")


def model_name(family: str) -> str:
    """The registered model (and experiment) of a target family: ``aerie-drafter-<family>``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", family.strip().lower()).strip("-")
    if not _FAMILY.match(slug):
        raise ValueError(f"target family {family!r} does not give a usable model name")
    return f"aerie-drafter-{slug}"


@dataclass(frozen=True)
class DrafterVersion:
    """One registered drafter version as the registry reports it."""

    model: str
    version: str
    source: str  # the artifact URI of the drafter directory
    run_id: str | None
    tags: dict[str, str] = field(default_factory=dict, hash=False)
    aliases: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> str | None:
        return self.tags.get(FINGERPRINT)

    @property
    def lineage(self) -> dict[str, Any]:
        """The version's lineage, parsed, from either tag layout (module docstring)."""
        return read_lineage(self.tags)

    @property
    def drafter_uri(self) -> str | None:
        """Storage key of the published drafter (a full URL if an older release registered
        it), if recorded."""
        value = self.lineage.get(DRAFTER_URI)
        return None if value is None else str(value)


@dataclass(frozen=True)
class Registration:
    """The outcome of :meth:`DrafterRegistry.publish`."""

    version: DrafterVersion
    run_id: str | None
    reused: bool  # the fingerprint was already registered; nothing new was written


def model_card(model: str, family: str) -> str:
    """The registered model's description: what its versions are and how to serve one."""
    return (f"Speculative-decoding drafters (EAGLE-3, EAGLE 3.1 or DFlash, as the version's "
            f"`algorithm` tag says) for the {family} policy, one version per Aerie refresh, "
            f"each trained on the RL steps of its window with the policy's own hidden states "
            f"and evaluated on held-out prompts. Alias `champion`: the drafter serving now; "
            f"`challenger`: the newest registered. A version's files are a draft-model "
            f"directory that SGLang and vLLM load (config.json, model.safetensors): e.g. "
            f"`python -m sglang.launch_server --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path <dir>` (DFLASH for DFlash); `mlflow artifacts "
            f"download -u models:/{model}/<version>` fetches one. Tags: fingerprint, "
            f"algorithm, RL step and τ; `lineage` (JSON) holds the rest (RL-step window, "
            f"policy, shards, vocab mapping, target layers, α, the Dagster run) and the "
            f"version's training run every key; `gate.<n>` each gate decision, `gate.decision` "
            f"the one that stands. Change the champion with `aerie promote VERSION --reason "
            f"WHY` or `aerie rollback` (the Dagster jobs promote_drafter_manually and "
            f"rollback_drafter), not by moving the alias by hand: they move the serving record, "
            f"the alias and the tags together and record who and why; while the alias "
            f"disagrees with the serving record, promotion and rollback refuse. Model: {model}.")


def describe_version(model: str, tags: Mapping[str, str],
                     standing: DecisionRecord | None = None) -> str:
    """A version's description: what the drafter is, its τ, and the gate's standing."""
    lineage = read_lineage(tags)
    window = lineage.get("rl_step_window") or ["?"]
    settings = lineage.get("settings") or {}
    spec = ", ".join(f"{k} {v}" for k, v in settings.items() if k in (
        "num_steps", "eagle_topk", "num_draft_tokens")) if isinstance(settings, dict) else ""
    tau = tags.get("tau")
    kind = _title(lineage.get("algorithm"))
    lines = [f"{kind} drafter of {model} for the policy of RL step {tags.get('rl_step', '?')}"
             f", trained on RL steps {window[0]}–{window[-1]} (fingerprint "
             f"{tags.get(FINGERPRINT, '?')[:12]})."]
    if tau is not None:
        lines.append(f"τ {float(tau):.2f} on held-out prompts" + (f" ({spec})." if spec
                                                                   else "."))
    lines.append(f"Gate: {standing.decision}, {standing.reasons[0]}" if standing and
                 standing.reasons else "Gate: not decided yet.")
    return " ".join(lines)


class DrafterRegistry:
    """Aerie's view of one target family's registered model."""

    fence_token: int | None = None  # the lease token this view writes under (fenced_by)

    def __init__(self, client: MlflowClient, family: str, *,
                 artifact_location: str | None = None, lock_path: str | Path | None = None,
                 lock_url: str | None = None, lock_timeout_s: float = 120.0):
        self.client = client
        self.family = family
        self.model_name = model_name(family)
        self.runs = TrainingRuns(client, self.model_name, artifact_location=artifact_location,
                                 family=family)
        self.lock_path = Path(lock_path) if lock_path else None
        self.lock_url = lock_url
        self.lock_timeout_s = lock_timeout_s

    @classmethod
    def connect(cls, tracking_uri: str, family: str, *, registry_uri: str | None = None,
                artifact_location: str | None = None, lock_path: str | Path | None = None,
                lock_url: str | None = None, lock_timeout_s: float = 120.0
                ) -> DrafterRegistry:
        """A registry over ``MlflowClient(tracking_uri, registry_uri or tracking_uri)``.

        With a ``sqlite:`` tracking store ``artifact_location`` is required: MLflow would
        otherwise put artifacts in ``./mlruns`` relative to the working directory. A sqlite
        store copied or moved together with its artifacts is pointed at them here.
        """
        from mlflow import MlflowClient

        if tracking_uri.startswith("sqlite:") and not artifact_location:
            raise ValueError("a sqlite tracking store needs an explicit artifact_location")
        client = MlflowClient(tracking_uri=tracking_uri,
                              registry_uri=registry_uri or tracking_uri)
        registry = cls(client, family, artifact_location=artifact_location,
                       lock_path=lock_path, lock_url=lock_url, lock_timeout_s=lock_timeout_s)
        registry.runs.follow_moved_store(registry_uri)
        return registry

    def __repr__(self) -> str:
        return f"DrafterRegistry({self.model_name!r}, {redacted(self.client.tracking_uri)!r})"

    # -- locking ----------------------------------------------------------------------
    def promotion_lock(self) -> AbstractContextManager[Any]:
        """The lock that serialises alias moves of this model: the PostgreSQL lease when
        ``lock_url`` is configured (across hosts), else a file lock when ``lock_path`` is
        (one host), else a lock shared by this process only."""
        if self.lock_url is not None:
            return PostgresLease(self.lock_url, self.model_name, timeout_s=self.lock_timeout_s)
        if self.lock_path is not None:
            return FileLock(self.lock_path, timeout_s=self.lock_timeout_s)
        return ProcessLock(self.model_name, self.lock_timeout_s)

    def fenced_by(self, held: Any) -> DrafterRegistry:
        """This registry with every MLflow write made under ``held``'s fence (a lease), and
        ``fence_token`` set; itself for a lock without a token (one host)."""
        if getattr(held, "token", None) is None:
            return self
        view = copy.copy(self)
        view.client = fenced(self.client, held, _CLIENT_WRITES)
        view.fence_token = held.token
        return view

    # -- registered model ---------------------------------------------------------------
    def ensure_model(self) -> None:
        """Create the registered model if it does not exist yet."""
        try:
            self.client.create_registered_model(
                self.model_name, tags={"aerie.family": self.family},
                description=model_card(self.model_name, self.family))
        except Exception as e:
            if error_code(e) != "RESOURCE_ALREADY_EXISTS":
                raise

    # -- versions ---------------------------------------------------------------------
    def find_version(self, fingerprint: str) -> DrafterVersion | None:
        """The version registered for ``fingerprint`` (the oldest, should several exist)."""
        check_fingerprint(fingerprint)
        try:
            found = self.client.search_model_versions(
                f"name = '{self.model_name}' and tag.{FINGERPRINT} = '{fingerprint}'")
        except Exception as e:
            if error_code(e) == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        if not found:
            return None
        oldest = min(found, key=lambda v: int(v.version))
        return self.get_version(str(oldest.version))

    def register(self, run_id: str | None, source: str,
                 lineage: Mapping[str, Any]) -> Registration:
        """Register ``source`` with validated lineage tags and alias it ``challenger``;
        returns the existing version instead when the fingerprint is already registered."""
        tags = lineage_tags(lineage)
        fingerprint = tags[FINGERPRINT]
        check_fingerprint(fingerprint)
        with self.promotion_lock() as held:
            registry = self.fenced_by(held)
            existing = registry.find_version(fingerprint)
            if existing is not None:
                registry._ensure_challenger(existing)
                return Registration(self.get_version(existing.version), existing.run_id,
                                    reused=True)
            registry.ensure_model()
            created = registry.client.create_model_version(
                self.model_name, source, run_id=run_id, tags=version_tags(lineage),
                description=describe_version(self.model_name, tags))
            version = str(created.version)
            registry.set_alias(CHALLENGER, version)
            log.info("registered %s version %s (%s)", self.model_name, version,
                     fingerprint[:12])
            return Registration(self.get_version(version), run_id, reused=False)

    def publish(self, *, drafter_dir: str | Path, lineage: Mapping[str, Any],
                params: Mapping[str, Any] | None = None,
                history: Sequence[Mapping[str, Any]] = (),
                metrics: Mapping[str, float] | None = None,
                charts: Sequence[str | Path] = (), run_name: str | None = None,
                run_tags: Mapping[str, Any] | None = None) -> Registration:
        """Register the drafter of ``lineage['fingerprint']`` from its training run (the run
        ``drafter_checkpoint`` kept open while it trained), adding the evaluation: lineage
        tags, ``metrics`` and ``charts``. A drafter without such a run (trained before runs
        were kept while training) gets one logged now from ``history`` and ``drafter_dir``.
        Idempotent by fingerprint."""
        tags = lineage_tags(lineage)
        fingerprint = tags[FINGERPRINT]
        existing = self.find_version(fingerprint)
        if existing is not None:
            return self.register(existing.run_id, existing.source, lineage)
        run_id = self.runs.find_run(fingerprint)
        if run_id is None:
            run_id = self.runs.start_run(fingerprint, params=params, run_name=run_name)
            try:
                self.runs.log_history(run_id, history)
                self.runs.log_drafter(run_id, drafter_dir)
            except BaseException:
                self.runs.finish_run(run_id, failed=True)
                raise
            self.runs.finish_run(run_id)
        self.runs.add_evaluation(run_id, {**tags, **(run_tags or {})}, metrics or {}, charts,
                                 step=_step_of(lineage))
        return self.register(run_id, self.runs.drafter_source(run_id), lineage)

    def get_version(self, version: str | int) -> DrafterVersion:
        mv = self.client.get_model_version(self.model_name, str(version))
        return DrafterVersion(model=self.model_name, version=str(mv.version), source=mv.source,
                              run_id=mv.run_id or None, tags=dict(mv.tags or {}),
                              aliases=tuple(sorted(mv.aliases or ())))

    def versions(self) -> list[DrafterVersion]:
        """All versions, oldest first."""
        return [self.get_version(v) for v in self.version_numbers()]

    def version_numbers(self) -> list[str]:
        """The numbers of all versions, oldest first (one search request)."""
        found = self.client.search_model_versions(f"name = '{self.model_name}'")
        return [str(n) for n in sorted(int(v.version) for v in found)]

    def set_tags(self, version: str, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.model_name, str(version), key,
                                              tag_value(value))

    # -- decisions --------------------------------------------------------------------
    def record_decision(self, version: str, record: DecisionRecord) -> int:
        """Keep ``record`` as the next decision ``n`` of ``version`` (tag ``gate.<n>``,
        written once) and return ``n``. Call under :meth:`promotion_lock`: n is read, then
        taken."""
        taken = self.decisions(version)
        n = max(taken, default=0) + 1
        self.set_tags(version, {f"gate.{n}": record.to_tag()})
        return n

    def set_standing(self, version: str, n: int) -> bool:
        """Make decision ``n`` of ``version`` its standing (``gate.decision``,
        ``gate.decision_id``); a ``refused`` or ``canary`` never replaces a ``promoted`` or
        ``forced`` standing. Returns whether the standing changed."""
        tags = self.get_version(version).tags
        record = decision_in(tags, n)
        if record.decision in (REFUSED, CANARY) and tags.get(STANDING) in (PROMOTED, FORCED):
            return False
        self.set_tags(version, {STANDING: record.decision, STANDING_ID: n})
        for key in LEGACY_STANDING:  # copies of an older standing would contradict it
            if key in tags:
                self.client.delete_model_version_tag(self.model_name, str(version), key)
        self.client.update_model_version(self.model_name, str(version),
                                         describe_version(self.model_name, tags, record))
        return True

    def decisions(self, version: str) -> dict[int, DecisionRecord]:
        """Every recorded decision of ``version`` by its number."""
        tags = self.get_version(version).tags
        return {n: decision_in(tags, n) for n in decision_numbers(tags)}

    def standing(self, version: str) -> DecisionRecord | None:
        """The decision that stands for ``version`` (None: none recorded yet)."""
        tags = self.get_version(version).tags
        n = tags.get(STANDING_ID)
        return decision_in(tags, int(n)) if n and n.isdigit() else None

    # -- aliases ----------------------------------------------------------------------
    def alias(self, alias: str) -> str | None:
        """The version ``alias`` points at, read from the server now (None if unset)."""
        try:
            aliases = self.client.get_registered_model(self.model_name).aliases or {}
        except Exception as e:
            if error_code(e) == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        value = aliases.get(alias)
        return None if value is None else str(value)

    def set_alias(self, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(self.model_name, alias, str(version))

    def delete_alias(self, alias: str) -> None:
        self.client.delete_registered_model_alias(self.model_name, alias)

    def champion(self) -> DrafterVersion | None:
        version = self.alias(CHAMPION)
        return None if version is None else self.get_version(version)

    def _ensure_challenger(self, version: DrafterVersion) -> None:
        """Re-run after a crash between creating a version and aliasing it: the newest
        version that is not champion should be the challenger."""
        newest = max(int(v.version) for v in self.client.search_model_versions(
            f"name = '{self.model_name}'"))
        if int(version.version) == newest and self.alias(CHAMPION) != version.version \
                and self.alias(CHALLENGER) != version.version:
            self.set_alias(CHALLENGER, version.version)


def _title(name: Any) -> str:
    """An algorithm's name for people (``EAGLE-3``), generic when none is recorded."""
    if isinstance(name, str) and name in ALGORITHMS:
        return ALGORITHMS[name].title
    return "Speculative-decoding"


def _step_of(lineage: Mapping[str, Any]) -> int:
    try:
        return int(lineage.get("rl_step", 0))
    except (TypeError, ValueError):
        return 0


