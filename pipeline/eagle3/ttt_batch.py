"""A TTT training batch: right-padded samples plus the teacher's targets on the draft vocab.

:func:`collate` turns shard samples into a :class:`TTTBatch`; the teacher (target logits
``final_hidden @ lm_head.T``, restricted to the draft vocab by ``t2d``, and the full-vocab
argmax) is computed in vocab chunks, only on the rows the loss reads
(:func:`teacher_rows`), so a 128k-vocab teacher never materialises (N, V) at once. The
logits are the target's own: :class:`LogitHead` applies what its family does after the
head matmul (Gemma's final soft-cap, Cohere's and Granite's scaling).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipeline.eagle3.model import Eagle3Drafter

DEFAULT_TEACHER_CHUNK = 8192


# -- the target's head -------------------------------------------------------------------
@dataclass(frozen=True)
class LogitHead:
    """What the target does to ``final_hidden @ lm_head.T``: multiply by ``scale``, then
    (when ``softcap``) ``softcap * tanh(logits / softcap)``. Both keep the argmax."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"logit {name} must be a positive number, got {value!r}")

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> LogitHead:
        """The head of a target's ``config.json``: ``final_logit_softcapping`` (Gemma 2/3),
        ``logit_scale`` (Cohere: multiplied), ``logits_scaling`` (Granite: divided)."""
        def number(key: str) -> float | None:
            value = config.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"config.json {key} {value!r} is not a positive number")
            return float(value)

        multiply, divide = number("logit_scale"), number("logits_scaling")
        return cls(scale=(multiply or 1.0) / (divide or 1.0),
                   softcap=number("final_logit_softcapping"))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


PLAIN_HEAD = LogitHead()


# -- the batch ---------------------------------------------------------------------------
@dataclass(eq=False)
class TTTBatch:
    """One right-padded training batch; row t of every field belongs to input token t."""

    input_ids: torch.Tensor  # (B, T) int64
    aux_hidden: torch.Tensor  # (B, T, 3·Ht) target aux states (any float dtype)
    target_logits_draft: torch.Tensor  # (B, T, Vd) teacher logits at t over the draft vocab
    target_argmax: torch.Tensor  # (B, T) int64 teacher's FULL-vocab argmax at t (target id)
    loss_mask: torch.Tensor  # (B, T) bool: token x_t is trained on
    attention_mask: torch.Tensor | None = None  # (B, T) bool real tokens; None = all real

    def to(self, device: torch.device | str) -> TTTBatch:
        def move(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device, non_blocking=True)

        return TTTBatch(move(self.input_ids), move(self.aux_hidden),
                        move(self.target_logits_draft), move(self.target_argmax),
                        move(self.loss_mask), move(self.attention_mask))

    @property
    def real(self) -> torch.Tensor:
        """(B, T) bool: real (non-padding) tokens."""
        if self.attention_mask is None:
            return torch.ones_like(self.loss_mask, dtype=torch.bool)
        return self.attention_mask.to(torch.bool)

    def validate(self, model: Eagle3Drafter) -> None:
        """Raise ``ValueError`` on shapes, dtypes or padding the TTT cannot handle."""
        cfg = model.config
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got {tuple(self.input_ids.shape)}")
        b, t = self.input_ids.shape
        expect = {
            "aux_hidden": (self.aux_hidden, (b, t, cfg.fc_in_features)),
            "target_logits_draft": (self.target_logits_draft, (b, t, cfg.draft_vocab_size)),
            "target_argmax": (self.target_argmax, (b, t)),
            "loss_mask": (self.loss_mask, (b, t)),
        }
        if self.attention_mask is not None:
            expect["attention_mask"] = (self.attention_mask, (b, t))
        for name, (x, shape) in expect.items():
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
        if self.input_ids.dtype != torch.int64 or self.target_argmax.dtype != torch.int64:
            raise ValueError("input_ids and target_argmax must be int64")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be bool, got {self.loss_mask.dtype}")
        if self.attention_mask is not None:
            real = self.attention_mask.to(torch.bool)
            # Right padding only: RoPE positions are 0..T-1 for every row.
            if not torch.equal(real, real.cummin(dim=1).values):
                raise ValueError("attention_mask must be right-padded (ones, then zeros)")


class _Sample(Protocol):
    input_ids: torch.Tensor  # (T,)
    loss_mask: torch.Tensor  # (T,)
    aux_hidden: torch.Tensor  # (T, 3H)
    final_hidden: torch.Tensor  # (T, H)


def collate(samples: Sequence[_Sample], lm_head_weight: torch.Tensor, t2d: torch.Tensor, *,
            pad_token_id: int = 0, device: torch.device | str | None = None,
            chunk_size: int = DEFAULT_TEACHER_CHUNK, head: LogitHead = PLAIN_HEAD) -> TTTBatch:
    """Right-pad shard samples (e.g. ``ShardSample``) into a :class:`TTTBatch`.

    Teacher targets come from ``final_hidden`` and the target's ``lm_head_weight`` (V, H)
    via :func:`teacher_targets`, computed on ``device`` (default: where the samples are), for
    the rows the loss reads (:func:`teacher_rows`) only; the other rows hold zeros.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    b, t = len(samples), max(lengths)
    dev = torch.device(device) if device is not None else samples[0].input_ids.device
    aux_dtype = samples[0].aux_hidden.dtype
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.int64, device=dev)
    loss_mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    attention_mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    aux = torch.zeros(b, t, samples[0].aux_hidden.shape[-1], dtype=aux_dtype, device=dev)
    for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[row, :n] = s.input_ids.to(dev, torch.int64)
        loss_mask[row, :n] = s.loss_mask.to(dev, torch.bool)
        attention_mask[row, :n] = True
        aux[row, :n] = s.aux_hidden.to(dev)
    final = torch.zeros(b, t, samples[0].final_hidden.shape[-1],
                        dtype=samples[0].final_hidden.dtype, device=dev)
    for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        final[row, :n] = s.final_hidden.to(dev)
    rows = teacher_rows(loss_mask & attention_mask)
    target_logits, target_argmax = teacher_batch(final, lm_head_weight.to(dev), t2d.to(dev),
                                                 rows, chunk_size=chunk_size, head=head)
    return TTTBatch(input_ids, aux, target_logits, target_argmax, loss_mask, attention_mask)


def teacher_rows(trained: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the teacher rows the loss can read, given ``trained`` (B, T) = real tokens
    under the loss mask.

    The teacher at row r predicts x_{r+1}; every step that uses row r predicts x_{r+1} (step
    i at position r-1-i), so the row matters iff x_{r+1} is trained. Row 0 never does (no
    step predicts x_1).
    """
    rows = torch.zeros_like(trained)
    rows[:, 1:-1] = trained[:, 2:]
    return rows


@torch.no_grad()
def teacher_batch(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
                  rows: torch.Tensor, *, chunk_size: int = DEFAULT_TEACHER_CHUNK,
                  head: LogitHead = PLAIN_HEAD) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`teacher_targets` for the ``rows`` (B, T) of ``final_hidden`` (B, T, H) only.

    Returns ``(logits (B, T, Vd) fp32, argmax (B, T) int64)``, zeros outside ``rows``.
    """
    b, t = rows.shape
    logits = torch.zeros(b, t, int(t2d.sum()), dtype=torch.float32, device=final_hidden.device)
    argmax = torch.zeros(b, t, dtype=torch.int64, device=final_hidden.device)
    logits[rows], argmax[rows] = teacher_targets(final_hidden[rows], lm_head_weight, t2d,
                                                 chunk_size=chunk_size, head=head)
    return logits, argmax


@torch.no_grad()
def teacher_targets(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                    t2d: torch.Tensor, *, chunk_size: int = DEFAULT_TEACHER_CHUNK,
                    head: LogitHead = PLAIN_HEAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher logits restricted to the draft vocab and the full-vocab argmax, in fp32.

    ``final_hidden`` (…, H) post-norm target states, ``lm_head_weight`` (V, H), ``t2d`` (V,)
    bool. Returns ``(logits (…, Vd) fp32, argmax (…) int64)``, where column j of ``logits`` is
    target id ``t2d.nonzero()[j]`` (draft order). One pass over V in chunks of
    ``chunk_size`` rows bounds memory at (N, chunk) instead of (N, V); ties in the argmax go
    to the smallest id, as with ``torch.argmax`` over the full row.
    """
    lead, hdim = final_hidden.shape[:-1], final_hidden.shape[-1]
    vocab = lm_head_weight.shape[0]
    if lm_head_weight.shape[1] != hdim or t2d.shape != (vocab,):
        raise ValueError(f"lm_head {tuple(lm_head_weight.shape)} and t2d {tuple(t2d.shape)} "
                         f"do not fit hidden size {hdim}")
    h = final_hidden.reshape(-1, hdim).float()  # (N, H)
    n = h.shape[0]
    draft_vocab = int(t2d.sum())
    out = torch.empty(n, draft_vocab, dtype=torch.float32, device=h.device)
    best = torch.full((n,), float("-inf"), device=h.device)
    arg = torch.zeros(n, dtype=torch.int64, device=h.device)
    col = 0
    for c0 in range(0, vocab, chunk_size):
        logits = head(h @ lm_head_weight[c0:c0 + chunk_size].float().T)  # (N, C)
        value, index = logits.max(dim=-1)
        better = value > best  # strict: an earlier chunk keeps a tie
        best = torch.where(better, value, best)
        arg = torch.where(better, index + c0, arg)
        keep = t2d[c0:c0 + chunk_size]
        k = int(keep.sum())
        out[:, col:col + k] = logits[:, keep]
        col += k
    return out.view(*lead, draft_vocab), arg.view(*lead)
