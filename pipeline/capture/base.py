"""The one interface every hidden-state capture backend implements.

EAGLE-3 needs, per token of a sample, the target's auxiliary layer outputs concatenated
low→mid→high (``aux_hidden``, ``[T, 3H]``; layer id ``l`` = OUTPUT of decoder layer ``l`` =
HF ``output_hidden_states[l + 1]``, the un-normalised residual stream) and the last layer's
state after the final norm (``final_hidden``, ``[T, H]``; teacher logits =
``lm_head(final_hidden)``). Backends return them per sample, row ``t`` for input token ``t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class CapturedStates:
    """The states of one sample: ``aux_hidden`` (T, 3H) and ``final_hidden`` (T, H)."""

    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor


class CaptureBackend(Protocol):
    """Turns token-id sequences into :class:`CapturedStates`, one per input, in order."""

    hidden_size: int
    aux_layer_ids: tuple[int, ...]

    def capture(self, batch: Sequence[Sequence[int]]) -> list[CapturedStates]: ...
