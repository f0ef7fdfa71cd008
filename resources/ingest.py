"""Which RL framework dump Aerie follows (``aerie ingest``, the ``dump_sensor``): from
``AERIE_INGEST_*`` in Dagster, from flags on the command line."""

import json
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from pipeline.adapters.readers import READERS, reader_for
from resources.env import resource_from_env

_ENV = {"framework": "AERIE_INGEST_FRAMEWORK", "directory": "AERIE_INGEST_DIR",
        "initial_policy": "AERIE_INGEST_INITIAL_POLICY",
        "checkpoints": "AERIE_INGEST_CHECKPOINTS", "pattern": "AERIE_INGEST_PATTERN",
        "sampling": "AERIE_INGEST_SAMPLING", "settle_s": "AERIE_INGEST_SETTLE_S",
        "allow_multi_turn_text": "AERIE_INGEST_ALLOW_MULTI_TURN_TEXT"}


class IngestResource(ConfigurableResource):
    """Which dump to follow. ``framework`` empty = none (the sensor skips)."""

    framework: str = Field(default="", description=f"one of {sorted(READERS)}")
    directory: str = Field(default="", description="the framework's dump directory")
    initial_policy: str = Field(default="", description="HF dir of the policy before RL "
                                "(version 0, and the tokenizer)")
    checkpoints: str = Field(default="", description="root of the framework's checkpoints "
                             "(default: the reader's own guess, else the dump directory)")
    pattern: str = Field(default="", description="checkpoint dir under the root, with {N} "
                         "(default: the framework's layout)")
    sampling: str = Field(default="", description='the rollout sampler as JSON, e.g. '
                          '{"temperature": 1.0, "top_p": 0.95} (default: what the dump says)')
    settle_s: float = Field(default=60.0, description="the newest file counts as complete "
                            "once unchanged this long")
    allow_multi_turn_text: bool = Field(default=False, description="keep multi-turn text "
                                        "records (no tool-token mask) instead of "
                                        "quarantining them")

    def ingestor(self, storage):
        """The :class:`~pipeline.adapters.ingest.Ingestor` of these settings on ``storage``."""
        from pipeline.adapters.ingest import Ingestor

        if self.framework not in READERS:
            raise ValueError(f"ingest: framework {self.framework!r} is not one of "
                             f"{sorted(READERS)}")
        for name in ("directory", "initial_policy"):
            if not getattr(self, name):
                raise ValueError(f"ingest: {name} is not set ({_ENV[name]})")
        return Ingestor(
            storage, reader_for(self.framework), Path(self.directory),
            Path(self.initial_policy), checkpoints=Path(self.checkpoints) if self.checkpoints
            else None, pattern=self.pattern or None,
            sampling=json.loads(self.sampling) if self.sampling else None,
            settle_s=self.settle_s, allow_multi_turn_text=self.allow_multi_turn_text)


def ingest_from_env() -> IngestResource:
    """Every field from its ``AERIE_INGEST_*`` variable where it is set, checked now."""
    return resource_from_env(IngestResource, "", names=_ENV)
