"""Serving records: speculative settings, what to serve, and the serving manifest.

A :class:`ServingManifest` says which drafter the rollout servers of one model should run
and with which SGLang arguments. It is what the ``manifest`` serving mode publishes for the
RL trainer's rollout launcher, and what every mode records after a successful update.

Invariants:

- Stdlib only, frozen, JSON round-trip with ``SCHEMA_VERSION``; a reader refuses a manifest
  written by a newer schema.
- The settings are :class:`~pipeline.evaluation.spec.SpecParams`, the same record (and
  SGLang rules) acceptance evaluation measures with.
- ``sglang_args`` hold the literal placeholder ``{drafter_dir}`` for the draft-model path:
  where the drafter lands is decided by whoever launches the server
  (:func:`ServingManifest.launch_args`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.evaluation.spec import SpecParams

SERVING_SCHEMA_VERSION = 1
DRAFTER_DIR = "{drafter_dir}"


def serving_args(settings: SpecParams, drafter_dir: str = DRAFTER_DIR) -> tuple[str, ...]:
    """SGLang's flags that serve an EAGLE-3 drafter from ``drafter_dir`` with ``settings``."""
    return ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter_dir,
            *settings.sglang_args())


@dataclass(frozen=True)
class ServingTarget:
    """A drafter to serve: where its files are and which registry version it is."""

    drafter_uri: str  # storage URL of the drafter directory (config.json + model.safetensors)
    fingerprint: str
    registry_model: str
    registry_version: str
    registry_source: str | None = None  # the MLflow artifact URI of the same files


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
    schema_version: int = SERVING_SCHEMA_VERSION

    def launch_args(self, drafter_dir: str) -> list[str]:
        """The SGLang arguments with the local drafter directory filled in ([] without one)."""
        return [drafter_dir if a == DRAFTER_DIR else a for a in self.sglang_args]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServingManifest:
        raw: dict[str, Any] = json.loads(text)
        if raw.get("schema_version") != SERVING_SCHEMA_VERSION:
            raise ValueError(f"serving manifest schema_version {raw.get('schema_version')!r} "
                             f"is not supported (expected {SERVING_SCHEMA_VERSION})")
        raw["target"] = ServingTarget(**raw["target"]) if raw["target"] else None
        raw["settings"] = SpecParams.from_dict(raw["settings"])
        raw["sglang_args"] = tuple(raw["sglang_args"])
        return cls(**raw)
