"""Lineage tags of a registered drafter version: required keys, string values, size limits.

A registered version must say where it came from: the RL-step window and the shard
manifests it learned from, the teacher policy, the aux layer ids, the vocab mapping, its
evaluation (τ, α), where the drafter files live and which Dagster run made it. Data in
Aerie's storage is named by its key under the storage root (``drafter_uri``
``drafters/step=000005``), so the tags stay true when the storage moves.

Invariants:

- :func:`lineage_tags` refuses a lineage that lacks any of :data:`REQUIRED_LINEAGE_KEYS` or
  has an empty value, and returns only strings (MLflow tag values are strings): ``str``
  values as they are, everything else as compact, key-sorted JSON (floats keep full
  precision), so a tag can be parsed back with :func:`parse_tag`.
- No value exceeds :data:`MAX_TAG_VALUE` characters (within MLflow's limits: 8,000 for run
  tags, 100,000 for model-version tags); a longer one is refused, never silently truncated.

A registered *version* shows a few tags (:func:`version_tags`): the headline a user reads and
filters on (:data:`HEADLINE`: fingerprint, algorithm, RL step, τ) and the rest of the record
as one compact JSON tag, ``lineage``. Its training run keeps every key as its own tag.
:func:`read_lineage` reads both that layout and the older one-tag-per-key layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

MAX_TAG_VALUE = 5000
MAX_VERSION_TAG_VALUE = 100_000  # MLflow 3's limit for a model-version tag value
TAG_DIGITS = 4  # tau, alpha and coverage in tags: shown rounded; the run holds every digit

FINGERPRINT = "fingerprint"
DRAFTER_URI = "drafter_uri"
REQUIRED_LINEAGE_KEYS = (
    FINGERPRINT,  # the training spec's fingerprint: the idempotency key of a registration
    DRAFTER_URI,  # storage key of the published drafter directory
    "rl_step",  # the refresh step the drafter was trained for
    "rl_step_window",  # RL steps whose rollouts it learned from
    "policy_uri",  # storage key of the teacher policy checkpoint
    "policy_sha256",
    "shard_manifest_sha256",  # {step: sha256 of that step's hidden-state shard manifest}
    "aux_layer_ids",
    "vocab_mapping_key",  # content hash of the vocab mapping's inputs and sizes
    "tau",
    "alpha",
    "dagster_run_id",
)
ALGORITHM = "algorithm"
HEADLINE = (FINGERPRINT, ALGORITHM, "rl_step", "tau")  # a version's own tags
LINEAGE = "lineage"  # the version tag holding the rest of the record (JSON)


class LineageError(ValueError):
    """A lineage record is incomplete or cannot be stored as tags."""


def tag_value(value: Any) -> str:
    """``value`` as an MLflow tag string (``str`` unchanged, else compact sorted JSON)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # "nan" / "inf": JSON has no spelling for them
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_jsonable)


def parse_tag(text: str) -> Any:
    """Inverse of :func:`tag_value` for non-string values (strings come back as they are)."""
    if text in ("nan", "inf", "-inf"):
        return float(text)
    try:
        return json.loads(text)
    except ValueError:
        return text


def lineage_tags(lineage: Mapping[str, Any], *,
                 required: tuple[str, ...] = REQUIRED_LINEAGE_KEYS) -> dict[str, str]:
    """Validated string tags for ``lineage`` (extra keys are kept)."""
    missing = [k for k in required if k not in lineage]
    empty = [k for k in required if k in lineage and lineage[k] in (None, "", [], {}, ())]
    if missing or empty:
        raise LineageError(f"lineage lacks required keys {missing} and has empty values for "
                           f"{empty}")
    tags = {str(k): tag_value(v) for k, v in lineage.items()}
    too_long = {k: len(v) for k, v in tags.items() if len(v) > MAX_TAG_VALUE}
    if too_long:
        raise LineageError(f"tag values longer than {MAX_TAG_VALUE} characters: {too_long}")
    return tags


def version_tags(lineage: Mapping[str, Any]) -> dict[str, str]:
    """A registered version's tags for a validated ``lineage`` record (its values as they
    are, not tag strings): the :data:`HEADLINE` keys as tags, everything else in one
    ``lineage`` JSON object (non-finite floats as null: strict JSON)."""
    rest = {str(k): _finite_json(v) for k, v in sorted(lineage.items()) if k not in HEADLINE}
    record = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                        allow_nan=False, default=_jsonable)
    if len(record) > MAX_VERSION_TAG_VALUE:
        raise LineageError(f"the lineage record is {len(record)} characters, over a version "
                           f"tag's {MAX_VERSION_TAG_VALUE}")
    return {**{k: tag_value(lineage[k]) for k in HEADLINE if k in lineage}, LINEAGE: record}


def _finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (an α position never reached) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


def read_lineage(tags: Mapping[str, str]) -> dict[str, Any]:
    """A version's lineage as parsed values, from either layout: headline tags plus the
    ``lineage`` record (:func:`version_tags`), or one tag per key (versions registered before
    it; the decision and promotion tags beside them are left out)."""
    if LINEAGE in tags:
        record = parse_tag(tags[LINEAGE])
        out = dict(record) if isinstance(record, dict) else {}
        out.update({k: parse_tag(tags[k]) for k in HEADLINE if k in tags})
        return out
    return {k: parse_tag(v) for k, v in tags.items() if not _decision_or_promotion(k)}


def _decision_or_promotion(key: str) -> bool:
    return key.startswith(("gate.", "post_promotion", "promot", "rolled_back", "rollback",
                           "reconcil", "forced_by", "force_reason", "previous_champion"))


def lineage_from_manifest(meta: Mapping[str, Any], *, drafter_uri: str, policy_uri: str,
                          tau: float, alpha: tuple[float, ...] | list[float],
                          dagster_run_id: str, **extra: Any) -> dict[str, Any]:
    """The lineage record (validated: :func:`lineage_tags` accepts it) from a drafter
    manifest's ``meta`` (see ``pipeline.training.stage``) plus what the manifest does not
    know: where it lives, the policy URI, its evaluation and the Dagster run. ``extra`` adds
    more keys (e.g. ``heldout_key``, ``settings_key``). Floats shown in tags are rounded."""
    record = {
        FINGERPRINT: meta.get("fingerprint"),
        DRAFTER_URI: drafter_uri,
        "rl_step": meta.get("step"),
        "rl_step_window": meta.get("window_steps"),
        "policy_uri": policy_uri,
        "policy_sha256": meta.get("policy_sha256"),
        "shard_manifest_sha256": meta.get("shard_manifest_sha256"),
        "aux_layer_ids": meta.get("aux_layer_ids"),
        "vocab_mapping_key": meta.get("vocab_cache_key"),
        "coverage": _rounded(meta.get("coverage")),
        "tau": round(float(tau), TAG_DIGITS),
        "alpha": [round(float(a), TAG_DIGITS) for a in alpha],
        "dagster_run_id": dagster_run_id,
        **({ALGORITHM: _algorithm(meta)} if _algorithm(meta) else {}),
        **extra,
    }
    lineage_tags(record)  # refuses a missing or empty key, or a value too long for a tag
    return record


def _algorithm(meta: Mapping[str, Any]) -> str | None:
    """The drafter family the manifest's training config names (None: not recorded)."""
    config = meta.get("config")
    value = config.get("drafter_algorithm") if isinstance(config, Mapping) else None
    return str(value) if value else None


def _rounded(value: Any) -> Any:
    """A float to :data:`TAG_DIGITS` places (what a tag shows); anything else unchanged."""
    return round(value, TAG_DIGITS) if isinstance(value, float) else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | set | frozenset):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
