"""The FP8 encoding of shard states: float8 e4m3 with a float32 scale per token.

One sample's ``(T, W)`` states become ``T · (W + 4)`` bytes: T little-endian float32 scales
(each token's absolute maximum over :data:`FP8_MAX`, e4m3's largest value), then the states
divided by their token's scale, rounded to the nearest float8 e4m3fn. Decoding multiplies
back in float32 and rounds to bf16, the dtype every shard reader hands out.

A float format keeps its 3 mantissa bits wherever a value lands between ``2^-6`` and 448
times its token's scale, so one scale per token holds layers of different magnitudes;
only values ~28,000× below the token's largest fall into e4m3's subnormals.
"""

from __future__ import annotations

import torch

from pipeline.capture.provenance import ENCODING

__all__ = ["FP8_LAYOUT", "FP8_MAX", "fp8_columns", "fp8_decode", "fp8_encode", "value_bytes"]

FP8_LAYOUT = ("fp8-encoded columns: T little-endian float32 scales, then the float8 e4m3fn "
              "bytes of the row-major (T, W) tensor divided row by row by its scale")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12  # an all-zero row: any scale decodes it to zeros
# float32 value of each of the 256 e4m3fn bytes: a table lookup decodes ~2x faster than
# torch's float8 -> float32 conversion on CPU, to the same bits
_E4M3_VALUES = (torch.arange(256, dtype=torch.int32).to(torch.uint8)
                .view(torch.float8_e4m3fn).float().numpy())


def value_bytes(tokens: int, width: int, fp8: bool) -> int:
    """Stored bytes of one sample's ``(T, W)`` states, bf16 or fp8."""
    return tokens * (width + 4) if fp8 else 2 * tokens * width


def fp8_columns(encoding: str) -> tuple[bool, bool]:
    """Whether ``aux_hidden`` and ``final_hidden`` are stored as fp8 under ``encoding``."""
    return encoding != ENCODING, encoding == "fp8"


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """``(T, W)`` states as one byte tensor: the T scales, then the scaled e4m3 values."""
    rows = x.detach().cpu().float()
    scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    values = (rows / scale[:, None]).to(torch.float8_e4m3fn)
    return torch.cat([scale.view(torch.uint8), values.view(torch.uint8).reshape(-1)])


def fp8_decode(raw: torch.Tensor, tokens: int, width: int) -> torch.Tensor:
    """The bf16 ``(T, W)`` states of :func:`fp8_encode`'s bytes (a new tensor)."""
    scale = raw[:4 * tokens].clone().view(torch.float32)  # a value may start at any byte
    values = torch.from_numpy(_E4M3_VALUES[raw[4 * tokens:].numpy()]).view(tokens, width)
    return values.mul_(scale[:, None]).to(torch.bfloat16)
