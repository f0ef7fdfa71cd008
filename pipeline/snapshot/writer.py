"""What an RL trainer calls once per step: :class:`SnapshotWriter`.

It publishes the step's policy checkpoint (``policies/step=NNNNNN/``), then the records
that pass the contract as ``rollouts/step=NNNNNN/part-*.parquet`` with the rejected ones
in ``quarantine.parquet``, then ``_manifest.json``: the completion marker the snapshot
sensor waits for. The step's sampler settings (:class:`~pipeline.sampling.SamplingParams`:
temperature, top_p, top_k, min_p), when the trainer passes them, go into the manifest's
``sampling`` meta: the evaluation measures acceptance at them.

A bad record never fails a step: it is quarantined with its field and reason (so is a
:class:`~.sieve.Refused` record, one its adapter refuses). What fails a
step is the step's own arguments (a :class:`~.sieve.StepArgumentError`, raised before
anything is written) or a ``records`` iterable that raises (a
:class:`~.sieve.SnapshotError`; the step stays uncommitted).
"""

from __future__ import annotations

import logging
import numbers
import operator
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline.contracts import Manifest
from pipeline.layout import raw_prefix
from pipeline.manifest import withdraw_manifest, write_manifest
from pipeline.sampling import SamplingError, SamplingParams
from pipeline.snapshot.policy import publish_policy
from pipeline.snapshot.render import quote, safe_repr, type_name
from pipeline.snapshot.schema import (
    DEFAULT_LIMITS,
    INT64_MAX,
    ROLLOUT_SCHEMA_VERSION,
    Limits,
)
from pipeline.snapshot.sieve import (
    RAW_KIND,
    Refused,
    Sieve,
    SnapshotError,
    SnapshotSummary,
    StepArgumentError,
    reason_counts,
    summary_meta,
    write_chunks,
    write_quarantine,
)
from pipeline.storage import Storage

log = logging.getLogger(__name__)


class SnapshotWriter:
    """What an RL trainer calls once per step: records plus the policy checkpoint dir."""

    def __init__(self, storage: Storage, *, limits: Limits = DEFAULT_LIMITS,
                 rows_per_file: int = 4096):
        self.storage, self.limits, self.rows_per_file = storage, limits, rows_per_file

    def write_step(self, step: int, records: Iterable[Mapping[str, Any]], policy_dir: Path,
                   policy_version: int,
                   sampling: SamplingParams | Mapping[str, Any] | None = None
                   ) -> SnapshotSummary:
        """Publish the policy, then the records, then the completion marker.

        Records lacking ``policy_uri`` get the published checkpoint's storage key. Rejected records
        go to ``quarantine.parquet`` with their reason; a re-run rewrites the same names.
        ``step`` and ``policy_version`` must be integers with 0 <= policy_version <= step
        (within int64), else :class:`StepArgumentError` before anything is written.
        ``sampling``: the sampler the RL engine generated this step's rollouts with (a
        mapping with SGLang's names, or :class:`SamplingParams`); None records nothing and
        the evaluation falls back to an earlier step's settings or greedy.
        """
        step = _step_integer("step", step)
        policy_version = _step_integer("policy_version", policy_version)
        if policy_version > step:
            raise StepArgumentError(f"step {step}: policy_version {policy_version} is newer "
                                    "than the step")
        sampler = _sampling(step, sampling)
        policy = publish_policy(self.storage, step, policy_dir)
        sieve = Sieve("writer", policy.vocab_size, step, self.limits)
        prefix = raw_prefix(step)
        defaults = {"policy_uri": policy.key}

        def accepted() -> Iterator[dict[str, Any]]:
            for row, raw in _rows(records, step):
                if isinstance(raw, Refused):
                    sieve.reject(raw.record, "adapter", row, raw.field, raw.reason)
                    continue
                rec = sieve.check(raw, "writer input", row, defaults)
                if rec is not None:
                    yield rec

        withdraw_manifest(self.storage, prefix)  # a re-run: readers see 'being rewritten'
        parts = write_chunks(self.storage, prefix, "part", accepted(), self.rows_per_file)
        quarantine = write_quarantine(self.storage, prefix, sieve.rejections)
        summary = SnapshotSummary(
            step=step, url=self.storage.url(prefix), records_in=sieve.accepted + len(
                sieve.rejections), accepted=sieve.accepted, quarantined=len(sieve.rejections),
            reasons=reason_counts(sieve.rejections), tokens=sieve.tokens, policy_uri=policy.key)
        write_manifest(self.storage, prefix, Manifest(
            kind=RAW_KIND, kind_version=ROLLOUT_SCHEMA_VERSION, files=(*parts, quarantine),
            meta=summary_meta(summary) | {
                "policy_version": policy_version, "policy_sha256": policy.sha256,
                "tokenizer_fingerprint": policy.tokenizer_fingerprint}
            | ({"sampling": sampler.to_dict()} if sampler is not None else {})))
        if summary.quarantined:
            log.warning("step %d: quarantined %d of %d records: %s", step, summary.quarantined,
                        summary.records_in, summary.reasons)
        return summary


def _step_integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StepArgumentError(f"{name} must be an integer, got {type_name(value)} "
                                f"{quote(safe_repr(value), 60)}")
    value = operator.index(value)
    if not 0 <= value <= INT64_MAX:
        raise StepArgumentError(f"{name} {quote(safe_repr(value), 60)} is outside "
                                f"[0, {INT64_MAX}]")
    return value


def _sampling(step: int, value: Any) -> SamplingParams | None:
    if value is None:
        return None
    try:
        return SamplingParams.from_mapping(value)
    except SamplingError as e:
        raise StepArgumentError(f"step {step}: {e}", field=f"sampling.{e.field}") from e


def _rows(records: Iterable[Any], step: int) -> Iterator[tuple[int, Any]]:
    """``enumerate(records)``; an iterable that raises fails the step, naming the row."""
    row = 0
    try:
        for row, raw in enumerate(records):
            yield row, raw
    except Exception as e:
        raise SnapshotError(f"step {step}: the records iterable raised {type_name(e)} after "
                            f"row {row}: {quote(safe_repr(e), 200)}; nothing committed") from e
