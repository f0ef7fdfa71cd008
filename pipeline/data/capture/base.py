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


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: ``[1, N//2 - 1, N - 4]`` for a target with N decoder layers."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(f"default aux layers {ids} are invalid for {num_layers} layers; "
                         "pass aux_layer_ids explicitly")
    return ids


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
