"""Following an RL framework's dump directory: ``aerie ingest`` and the ``dump_sensor``.

Both drive :class:`pipeline.adapters.ingest.Ingestor` with the same settings
(:class:`resources.ingest.IngestResource`; in Dagster from ``AERIE_INGEST_*``, on the
command line from flags). The sensor requests an ``ingest_dumps`` run whenever the
directory holds a step whose snapshot is not committed yet; the run writes those
snapshots, and the snapshot sensor then ingests them like any trainer's. ``aerie ingest
--follow`` does the writing itself, polling the directory.
"""

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from dagster import (
    DefaultSensorStatus,
    OpExecutionContext,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    job,
    op,
    sensor,
)

from pipeline.layout import raw_prefix
from pipeline.manifest import manifest_key
from pipeline.storage import Storage
from resources.ingest import IngestResource
from resources.storage import StorageResource


@op(description="Write the complete, uncommitted steps of the configured dump directory as "
                "rollout snapshots (bad files quarantined with their reason).")
def ingest_dump_files(context: OpExecutionContext, storage: StorageResource,
                      ingest: IngestResource) -> dict[str, Any]:
    report = ingest.ingestor(storage.checked()).run_once().to_dict()
    for name, reason in report["files_quarantined"].items():
        context.log.warning(f"{name}: quarantined: {reason}")
    context.log.info(json.dumps(report))
    return report


@job(description="Follow an RL framework's dump directory into rollout snapshots.")
def ingest_dumps():
    ingest_dump_files()


@sensor(job=ingest_dumps, minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.STOPPED,
        description="Every 30 s: runs ingest_dumps when the configured dump directory "
                    "holds a step whose snapshot is not committed yet.")
def dump_sensor(context: SensorEvaluationContext, storage: StorageResource,
                ingest: IngestResource):
    if not ingest.framework:
        return SkipReason("no dump directory configured (AERIE_INGEST_FRAMEWORK)")
    from pipeline.adapters.readers import reader_for

    store = storage.checked()
    reader = reader_for(ingest.framework)
    new = [f for f in reader.step_files(Path(ingest.directory))
           if not store.exists(manifest_key(raw_prefix(f.step)))]
    if not new:
        return SkipReason("every step file of the dump is committed")
    stamp = "".join(f"{f.path.name}:{f.path.stat().st_mtime_ns};" for f in new)
    return RunRequest(run_key=hashlib.sha256(stamp.encode()).hexdigest()[:32])


def follow(settings: IngestResource, storage: Storage, *, poll_s: float,
           passes: int | None = None) -> list[dict[str, Any]]:
    """``aerie ingest``: one pass, or (``passes`` None with ``poll_s``) until interrupted."""
    ingestor = settings.ingestor(storage)
    reports = []
    while True:
        reports.append(ingestor.run_once().to_dict())
        print(json.dumps(reports[-1]), flush=True)
        if passes is not None and len(reports) >= passes:
            return reports
        time.sleep(poll_s)
