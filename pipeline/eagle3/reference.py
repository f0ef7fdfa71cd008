"""Plain references for the TTT numerics, written to be read rather than run fast.

:func:`reference_ttt_loss` is the loss of :mod:`pipeline.eagle3.ttt` as explicit loops, and
:func:`masked_chain_attention` the attention of :mod:`pipeline.eagle3.chain_attention` as one
masked softmax. The fast versions are tested equal to these (tests/eagle3).
"""

from __future__ import annotations

import math

import torch

from pipeline.eagle3.drafting import draft_reference_logits
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.ttt_batch import TTTBatch


def reference_ttt_loss(model: Eagle3Drafter, batch: TTTBatch, depth: int, decay: float = 0.8
                       ) -> tuple[float, list[float], list[float], list[int]]:
    """:func:`~pipeline.eagle3.ttt.ttt_loss` spelled out: Python loops over rows, steps and
    positions, logits from KV-cache drafting (:func:`draft_reference_logits`), the soft
    cross-entropy against the teacher in float64. Returns ``(total, loss per step, accuracy
    per step, counted positions per step)``; ``total`` weighs step i by ``decay ** i``."""
    t2d = model.t2d.tolist()
    d2t = model.d2t.tolist()
    ce_sum, count, correct = [0.0] * depth, [0] * depth, [0] * depth
    for b in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[b].sum())
        logits = draft_reference_logits(model, batch.input_ids[b, :n],
                                        batch.aux_hidden[b, :n], depth).double()
        for i in range(depth):
            for t in range(n):
                # chain from t, step i: input token x_{t+1+i}; it predicts x_{t+2+i},
                # with the teacher's distribution at t+1+i.
                predicted, teacher = t + 2 + i, t + 1 + i
                if predicted >= n or not bool(batch.loss_mask[b, predicted]):
                    continue
                top = int(batch.target_argmax[b, teacher])
                if not t2d[top]:
                    continue
                z = batch.target_logits_draft[b, teacher].double().tolist()
                zmax = max(z)
                p = [math.exp(v - zmax) for v in z]
                p = [v / sum(p) for v in p]
                row = logits[i, t].tolist()
                rmax = max(row)
                log_norm = rmax + math.log(sum(math.exp(v - rmax) for v in row))
                ce_sum[i] += -sum(pk * (rk - log_norm) for pk, rk in zip(p, row, strict=True))
                count[i] += 1
                draft_top = row.index(rmax)
                correct[i] += int(draft_top + d2t[draft_top] == top)
    step_loss = [s / c if c else 0.0 for s, c in zip(ce_sum, count, strict=True)]
    acc = [k / c if c else 0.0 for k, c in zip(correct, count, strict=True)]
    total = sum(decay ** i * lo for i, lo in enumerate(step_loss))
    return total, step_loss, acc, count


def masked_chain_attention(q, prefix_k, prefix_v, chain_k, chain_v, scale):
    """What :mod:`pipeline.eagle3.chain_attention` computes, written as one masked softmax
    over [prefix keys ; chain keys of every position] (a (B, h, T, T(1+i)) score tensor, so
    small inputs only): query t sees prefix keys 0..t and, of each chain step, the key at t.
    Inputs in (B, h, T, d) layout."""
    t = q.shape[2]
    keys = torch.cat([prefix_k, *chain_k], dim=2)
    values = torch.cat([prefix_v, *chain_v], dim=2)
    scores = (q @ keys.transpose(-1, -2)) * scale
    pos = torch.arange(t)
    allowed = [pos[None, :] <= pos[:, None]]  # prefix: causal
    allowed += [pos[None, :] == pos[:, None]] * len(chain_k)  # chain: same position only
    scores = scores.masked_fill(~torch.cat(allowed, dim=1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ values
