"""Each asset's Dagster code version: the schema versions of what it writes, read from the
pipeline's own constants. When a release changes the layout of an asset's output, its code
version changes with it, and the catalog marks the partitions materialized before as
unsynced ("code version changed"). An asset with no schema of its own carries ``1``: bump
it by hand when what it writes changes."""

from pipeline.formats import (
    CHECKPOINT_SCHEMA_VERSION,
    FP8_SCHEMA_VERSION,
    REPORT_SCHEMA_VERSION,
    ROLLOUT_SCHEMA_VERSION,
    SHARD_SCHEMA_VERSION,
    TOKENIZED_SCHEMA_VERSION,
    VOCAB_SCHEMA_VERSION,
)
from pipeline.monitor.observed import SCHEMA_VERSION as OBSERVED_SCHEMA_VERSION
from pipeline.release.gate import DECISION_SCHEMA_VERSION, GATE_SCHEMA_VERSION
from pipeline.serving_now import SERVING_SCHEMA_VERSION
from pipeline.training.spec import SPEC_SCHEMA_VERSION

CODE_VERSIONS = {
    "rollout_snapshot": f"rollout-{ROLLOUT_SCHEMA_VERSION}",
    "tokenized_rollouts": f"tokenized-{TOKENIZED_SCHEMA_VERSION}",
    "hidden_state_shards": f"shards-{SHARD_SCHEMA_VERSION}.fp8-{FP8_SCHEMA_VERSION}",
    "vocab_mapping": f"vocab-{VOCAB_SCHEMA_VERSION}",
    "drafter_checkpoint": f"spec-{SPEC_SCHEMA_VERSION}.checkpoint-{CHECKPOINT_SCHEMA_VERSION}",
    "acceptance_eval": f"report-{REPORT_SCHEMA_VERSION}",
    "registered_drafter": "1",
    "serving_drafter": (f"gate-{GATE_SCHEMA_VERSION}.decision-{DECISION_SCHEMA_VERSION}"
                        f".serving-{SERVING_SCHEMA_VERSION}"),
    "storage_retention": "1",
    "serving_acceptance": f"observed-{OBSERVED_SCHEMA_VERSION}",
}
