"""DFlash's training objective: blocks at sampled anchors, position-decayed cross-entropy.

Per sequence (tokens ``x``, loss mask ``m``, target features at every position):

    anchors  A ⊂ {a : m[a] and m[a+1]}, |A| = min(num_anchors, #valid), drawn uniformly
             without replacement (torch's global generator: a resumed run redraws the same)
    block a  tokens [x_a, MASK, …, MASK] at positions a .. a+B-1; each of its queries sees the
             context (features) at positions < a and the whole block, nothing of other blocks
    slot j   (1 <= j < B) predicts x[a+j], weight m[a+j] · exp(-(j-1)/γ) (0 past the end)
    loss     Σ CE · weight / Σ weight   over the target's whole vocab (its frozen head)
    KD       (``kd``) CE against the target's own distribution at the label's previous
             position, softmax(lm_head(final_hidden[a+j-1])), instead of the token
             (ModelOpt's variant); accuracy is still counted against the token

The anchor's own features are excluded because at serving time the anchor is the bonus token
of the last verification, whose target state does not exist yet. Metrics per slot (loss,
accuracy of the argmax, count) feed the same per-depth sums as TTT
(:class:`~pipeline.training.metrics.MetricSums`, depth ``B - 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.dflash.model import DFlashDrafter
from pipeline.eagle3.ttt import TTTMetrics, simulated_accept_length

GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}  # SpecForge's decay per block size


def default_gamma(block_size: int) -> float:
    """SpecForge's γ for its block sizes (16: 7, 10: 5, 8: 4); ``B / 2`` otherwise."""
    return GAMMAS.get(block_size, block_size / 2)


@dataclass(eq=False)
class BlockBatch:
    """Right-padded samples; row t of every field belongs to token t."""

    input_ids: torch.Tensor  # (B, T) int64
    aux_hidden: torch.Tensor  # (B, T, K·H) target layer outputs
    loss_mask: torch.Tensor  # (B, T) bool
    attention_mask: torch.Tensor  # (B, T) bool: real tokens (ones, then zeros)
    final_hidden: torch.Tensor | None = None  # (B, T, H) the target's post-norm states (KD)

    @property
    def real(self) -> torch.Tensor:
        return self.attention_mask


class _Sample(Protocol):
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor


def collate(samples: Sequence[_Sample], *, device: torch.device | str | None = None
            ) -> BlockBatch:
    """Right-pad shard samples into a :class:`BlockBatch` (the target's final states kept
    for KD; the teacher's logits are computed only at the rows the loss reads)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    b, t = len(samples), max(lengths)
    dev = torch.device(device) if device is not None else samples[0].input_ids.device
    width = samples[0].aux_hidden.shape[-1]
    ids = torch.zeros(b, t, dtype=torch.int64, device=dev)
    mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    real = torch.zeros(b, t, dtype=torch.bool, device=dev)
    aux = torch.zeros(b, t, width, dtype=samples[0].aux_hidden.dtype, device=dev)
    final = torch.zeros(b, t, samples[0].final_hidden.shape[-1],
                        dtype=samples[0].final_hidden.dtype, device=dev)
    for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        ids[row, :n] = s.input_ids.to(dev, torch.int64)
        mask[row, :n] = s.loss_mask.to(dev, torch.bool)
        real[row, :n] = True
        aux[row, :n] = s.aux_hidden.to(dev)
        final[row, :n] = s.final_hidden.to(dev)
    return BlockBatch(ids, aux, mask, real, final)


@dataclass(frozen=True)
class Blocks:
    """The blocks of one batch, laid out for :meth:`DFlashDrafter.blocks`."""

    tokens: torch.Tensor  # (B, Q) int64, Q = anchors · block_size
    positions: torch.Tensor  # (B, Q)
    allowed: torch.Tensor  # (B, Q, T + Q) bool
    labels: torch.Tensor  # (B, Q) int64
    weight: torch.Tensor  # (B, Q) fp32: 0 where nothing is scored
    slot: torch.Tensor  # (B, Q) int64: j in 0..B-1


def valid_anchors(loss_mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(T,) bool: positions a with ``m[a]`` and ``m[a+1]`` (both real)."""
    m = loss_mask & real
    out = torch.zeros_like(m)
    out[:-1] = m[:-1] & m[1:]
    return out


def lay_out(batch: BlockBatch, block_size: int, num_anchors: int, mask_token_id: int,
            gamma: float, anchors: Sequence[Sequence[int]] | None = None) -> Blocks:
    """Draw the anchors of every row (or take ``anchors``, per row) and lay out their blocks.
    Rows with fewer anchors are padded with blocks that see only themselves and score
    nothing."""
    b, t = batch.input_ids.shape
    dev = batch.input_ids.device
    if anchors is None:
        anchors = []
        for row in range(b):
            valid = valid_anchors(batch.loss_mask[row], batch.real[row]).nonzero().flatten()
            pick = torch.randperm(len(valid))[:num_anchors].to(dev)
            anchors.append(sorted(valid[pick].tolist()))
    n = max(1, max(len(a) for a in anchors))
    q = n * block_size
    slot = torch.arange(block_size, device=dev).repeat(n)  # (Q,)
    group = torch.arange(n, device=dev).repeat_interleave(block_size)  # (Q,)
    decay = torch.exp(-(slot.float() - 1).clamp(min=0) / gamma)
    tokens = torch.full((b, q), mask_token_id, dtype=torch.int64, device=dev)
    positions = torch.zeros(b, q, dtype=torch.int64, device=dev)
    allowed = torch.zeros(b, q, t + q, dtype=torch.bool, device=dev)
    labels = torch.zeros(b, q, dtype=torch.int64, device=dev)
    weight = torch.zeros(b, q, dtype=torch.float32, device=dev)
    same_block = group[:, None] == group[None, :]  # (Q, Q)
    lengths = batch.real.sum(dim=1).tolist()
    for row, chosen in enumerate(anchors):
        k = len(chosen)
        a = torch.zeros(n, dtype=torch.int64, device=dev)
        a[:k] = torch.as_tensor(list(chosen), dtype=torch.int64, device=dev)
        start = a.repeat_interleave(block_size)  # (Q,)
        pos = start + slot
        used = group < k  # (Q,) queries of real anchors
        positions[row] = torch.where(used, pos, slot)
        tokens[row, slot == 0] = torch.where(used[slot == 0], batch.input_ids[row, a],
                                             mask_token_id)
        allowed[row, :, :t] = (torch.arange(t, device=dev)[None, :] < start[:, None]) \
            & used[:, None]
        allowed[row, :, t:] = same_block & (used[:, None] | torch.eye(q, dtype=torch.bool,
                                                                      device=dev))
        inside = used & (slot > 0) & (pos < lengths[row])
        at = pos.clamp(max=t - 1)
        labels[row] = torch.where(inside, batch.input_ids[row, at], 0)
        weight[row] = torch.where(inside & batch.loss_mask[row, at], decay, 0.0)
    return Blocks(tokens, positions, allowed, labels, weight, slot.expand(b, q))


def block_loss(model: DFlashDrafter, batch: BlockBatch, num_anchors: int, *,
               gamma: float | None = None, anchors: Sequence[Sequence[int]] | None = None,
               kd: bool = False) -> tuple[torch.Tensor, TTTMetrics]:
    """The weighted block cross-entropy and its per-slot metrics (module docstring); ``kd``:
    against the target's distributions instead of the tokens."""
    cfg = model.config
    blocks = lay_out(batch, cfg.block_size, num_anchors, cfg.mask_token_id,
                     gamma if gamma else default_gamma(cfg.block_size), anchors)
    b, t = batch.input_ids.shape
    positions = torch.arange(t, device=batch.input_ids.device).expand(b, t)
    context = model.context_kv(model.context(batch.aux_hidden), positions)
    hidden = model.blocks(blocks.tokens, blocks.positions, context, blocks.allowed)
    scored = blocks.weight > 0  # (B, Q)
    logits = model.compute_logits(hidden[scored]).float()  # (N, V)
    labels, weight, slot = blocks.labels[scored], blocks.weight[scored], blocks.slot[scored]
    if kd:
        if batch.final_hidden is None:
            raise ValueError("KD needs the target's final states in the batch")
        row = torch.arange(b, device=logits.device)[:, None].expand_as(scored)[scored]
        with torch.no_grad():  # the teacher at a+j-1 predicts the token at a+j
            states = batch.final_hidden[row, blocks.positions[scored] - 1].float()
            teacher = torch.softmax(states @ model.head.float().T, dim=-1)  # (N, V)
        ce = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1)  # (N,)
    else:
        ce = F.cross_entropy(logits, labels, reduction="none")  # (N,)
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-12)
    return loss, _metrics(loss, ce.detach(), logits.detach().argmax(-1) == labels, slot,
                          cfg.block_size)


def _metrics(loss: torch.Tensor, ce: torch.Tensor, correct: torch.Tensor, slot: torch.Tensor,
             block_size: int) -> TTTMetrics:
    step_loss, accuracy, count = [], [], []
    for j in range(1, block_size):
        at = slot == j
        n = int(at.sum())
        count.append(n)
        step_loss.append(float(ce[at].mean()) if n else 0.0)
        accuracy.append(float(correct[at].float().mean()) if n else 0.0)
    return TTTMetrics(float(loss.detach()), step_loss, accuracy, count,
                      simulated_accept_length(accuracy))


class BlockObjective(nn.Module):
    """The drafter with its block loss as ``forward``, so DeepSpeed's engine runs the loss."""

    def __init__(self, drafter: DFlashDrafter, num_anchors: int, gamma: float,
                 kd: bool = False):
        super().__init__()
        self.drafter, self.num_anchors, self.gamma, self.kd = drafter, num_anchors, gamma, kd
        self.depth = drafter.config.block_size - 1  # metric slots

    def forward(self, batch: BlockBatch) -> tuple[torch.Tensor, TTTMetrics]:
        return block_loss(self.drafter, batch, self.num_anchors, gamma=self.gamma, kd=self.kd)
