"""What an RL trainer calls once per step: :class:`SnapshotWriter`.

It publishes the step's policy checkpoint (``policies/step=NNNNNN/``), then the records
that pass the contract as ``rollouts/step=NNNNNN/part-*.parquet`` with the rejected ones
in ``quarantine.parquet``, then ``_manifest.json``: the completion marker the snapshot
sensor waits for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline.contracts import Manifest
from pipeline.layout import raw_prefix
from pipeline.manifest import write_manifest
from pipeline.snapshot.policy import publish_policy
from pipeline.snapshot.schema import (
    DEFAULT_LIMITS,
    ROLLOUT_SCHEMA_VERSION,
    Limits,
)
from pipeline.snapshot.sieve import (
    RAW_KIND,
    Sieve,
    SnapshotSummary,
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
                   policy_version: int) -> SnapshotSummary:
        """Publish the policy, then the records, then the completion marker.

        Records lacking ``policy_uri`` get the published checkpoint's URI. Rejected records
        go to ``quarantine.parquet`` with their reason; a re-run rewrites the same names.
        """
        policy = publish_policy(self.storage, step, policy_dir)
        sieve = Sieve("writer", policy.vocab_size, step, self.limits)
        prefix = raw_prefix(step)

        def accepted() -> Iterator[dict[str, Any]]:
            for row, raw in enumerate(records):
                if isinstance(raw, Mapping) and "policy_uri" not in raw:
                    raw = {**raw, "policy_uri": policy.uri}
                rec = sieve.check(raw, "writer input", row)
                if rec is not None:
                    yield rec

        parts = write_chunks(self.storage, prefix, "part", accepted(), self.rows_per_file)
        quarantine = write_quarantine(self.storage, prefix, sieve.rejections)
        summary = SnapshotSummary(
            step=step, url=self.storage.url(prefix), records_in=sieve.accepted + len(
                sieve.rejections), accepted=sieve.accepted, quarantined=len(sieve.rejections),
            reasons=reason_counts(sieve.rejections), tokens=sieve.tokens, policy_uri=policy.uri)
        write_manifest(self.storage, prefix, Manifest(
            kind=RAW_KIND, kind_version=ROLLOUT_SCHEMA_VERSION, files=(*parts, quarantine),
            meta=summary_meta(summary) | {
                "policy_version": policy_version, "policy_sha256": policy.sha256,
                "tokenizer_fingerprint": policy.tokenizer_fingerprint}))
        if summary.quarantined:
            log.warning("step %d: quarantined %d of %d records: %s", step, summary.quarantined,
                        summary.records_in, summary.reasons)
        return summary
