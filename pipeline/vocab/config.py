"""Defaults of the vocab stage.

Torch-free, so that Dagster run config can mirror it without loading torch with the
definitions.
"""

from __future__ import annotations

DEFAULT_DRAFT_VOCAB_SIZE = 32000  # EAGLE-3's draft vocab (capped by the target vocab)
