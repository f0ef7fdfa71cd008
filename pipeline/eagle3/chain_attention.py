"""Attention of the TTT draft chain without a (B, heads, T, T) score tensor.

At step i, position t attends to the real prefix (step-0 keys 0..t, causal) and the keys of
steps 1..i at the same position t. The prefix goes through ``scaled_dot_product_attention``
(flash / memory-efficient kernels) with one extra "sink" channel that carries its softmax
normaliser; the ≤ K-1 chain keys are per-position dot products; the two parts are merged
exactly (:func:`gathered_chain_attention`). :class:`ChainAttention` holds a step's keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipeline.eagle3.model import repeat_kv

QUERY_CHUNK = 64  # queries per attention call of a gathered chain step


# -- the parallel chain ------------------------------------------------------------------
def gathered_chain_attention(q: torch.Tensor, rows: torch.Tensor,
                             sink_prefix: tuple[torch.Tensor, torch.Tensor],
                             chain_k: Sequence[torch.Tensor], chain_v: Sequence[torch.Tensor],
                             scale: float, *, chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """Attention of draft step i ≥ 1 for a subset of positions (the ones the loss needs).

    ``q`` (N, h, d): queries at the flat positions ``rows`` (N,) = b·T + t, increasing;
    ``sink_prefix``: the step-0 keys/values with the sink, (B, h, T+1, W) from
    :func:`prefix_with_sink`; ``chain_k``/``chain_v``: i tensors (N, h, d), the keys of
    steps 1..i at the same rows (position t's chain key only ever meets query t). Query
    (b, t) sees prefix keys (b, 0..t) and its own chain keys. Returns (N, h, d).

    The chain part is i per-row dot products: scores c (N, h, i), its log-sum-exp lse_c and
    output o_c = softmax(c) · v, all on the N rows. The prefix part goes through
    ``scaled_dot_product_attention`` (flash kernel) with one extra "sink" key in front that
    every query sees, whose score for query t is exactly lse_c[t] and whose value is a unit
    vector in an extra channel. That kernel then returns, for each t, the prefix output
    already weighted by Z_prefix / (Z_prefix + Z_chain) in channels :d, and
    Z_chain / (Z_prefix + Z_chain) in channel d; adding (channel d) · o_c gives the exact
    softmax over prefix ∪ chain keys, differentiable throughout. Layout (W = d + 2 rounded
    up to 8):

        query row (b, t)  [q_t, lse_c[t]/scale split hi+lo, 0…]
        key row 0         [0…0, 1, 1, 0…]   (the sink; scale·q·k = lse_c)
        key row s + 1     [k_s, 0, 0, 0…]
        value row 0       [0…0, 1, 0…]
        value row s + 1   [v_s, 0, 0…]

    A subset of queries has no ``is_causal`` shortcut, so the kernel runs on chunks of
    ≤ ``chunk`` consecutive rows of one sequence, each against the keys up to its last
    position with a (rows, keys) boolean causal mask: about N·T/2 scores in all instead of
    T²/2, and no tensor larger than chunk × (T+1). The hi/lo split keeps lse_c exact to
    ~16 bits in bf16 (lo is 0 in fp32).
    """
    n, nh, d = q.shape
    dtype = q.dtype
    k_aug, v_aug = sink_prefix
    t = k_aug.shape[2] - 1
    # chain part, fp32: (N, h, i)
    scores = torch.stack([(q.float() * k.float()).sum(-1) for k in chain_k], dim=-1) * scale
    lse_c = torch.logsumexp(scores, dim=-1)  # (N, h)
    weights = torch.exp(scores - lse_c[..., None])  # (N, h, i)
    o_c = sum(weights[..., j, None] * v.float() for j, v in enumerate(chain_v))  # (N, h, d)

    x = lse_c / scale
    x_hi = x.to(dtype)
    x_lo = (x - x_hi.float()).to(dtype)
    width = k_aug.shape[-1]
    q_aug = torch.cat([q, x_hi[..., None], x_lo[..., None],
                       q.new_zeros(n, nh, width - d - 2)], dim=-1)  # (N, h, W)
    outs = []
    for b, start, end, last in _query_chunks(rows, k_aug.shape[0], t, chunk):
        keys = last + 2  # the sink and prefix positions 0..last
        position = rows[start:end] - b * t  # (n_c,)
        visible = torch.arange(keys, device=rows.device) <= position[:, None] + 1  # (n_c, L)
        out = F.scaled_dot_product_attention(
            q_aug[start:end].transpose(0, 1)[None], k_aug[b:b + 1, :, :keys],
            v_aug[b:b + 1, :, :keys], attn_mask=visible, scale=scale)  # (1, h, n_c, W)
        outs.append(out[0].transpose(0, 1))
    out = torch.cat(outs) if outs else q_aug  # (N, h, W)
    return (out[..., :d].float() + out[..., d:d + 1].float() * o_c).to(dtype)


def _query_chunks(rows: torch.Tensor, batch: int, t: int, chunk: int
                  ) -> list[tuple[int, int, int, int]]:
    """Split increasing flat positions ``rows`` = b·T + pos into runs of ≤ ``chunk`` rows of
    one sequence: ``(b, start, end, last pos)`` with ``rows[start:end]`` the run."""
    counts = torch.bincount(rows // t, minlength=batch).tolist()
    flat = rows.tolist()  # one host copy: the chunk bounds are Python ints
    chunks, offset = [], 0
    for b, count in enumerate(counts):
        for start in range(offset, offset + count, chunk):
            end = min(start + chunk, offset + count)
            chunks.append((b, start, end, flat[end - 1] - b * t))
        offset += count
    return chunks


def _sink_width(d: int) -> int:
    return -(-(d + 2) // 8) * 8  # d + 2 channels, rounded up to a multiple of 8 for kernels


def prefix_with_sink(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, h, T, d) prefix keys/values -> (B, h, T+1, width) with the sink at row 0."""
    b, nh, t, d = k.shape
    width = _sink_width(d)
    k_aug = k.new_zeros(b, nh, t + 1, width)
    k_aug[:, :, 0, d:d + 2] = 1.0
    k_aug[:, :, 1:, :d] = k
    v_aug = v.new_zeros(b, nh, t + 1, width)
    v_aug[:, :, 0, d] = 1.0
    v_aug[:, :, 1:, :d] = v
    return k_aug, v_aug


class ChainAttention:
    """The attention pattern of the parallel chain, for :meth:`Eagle3Drafter.step`.

    :meth:`prefix` is step 0's attention (causal over its own keys, the real prefix, which
    it keeps); :meth:`chain` is step i ≥ 1's, on the rows that step runs at: it adds the
    step's keys to the chain and attends with :func:`gathered_chain_attention`. Before a
    step that runs at fewer rows, :meth:`keep` drops the others' chain keys.
    """

    def __init__(self, n_rep: int, scale: float):
        self.n_rep = n_rep
        self.scale = scale
        self.prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, h, T, d)
        self.sink_prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # built once
        self.chain_k: list[torch.Tensor] = []  # (N, h, d) per step ≥ 1, on the current rows
        self.chain_v: list[torch.Tensor] = []

    def prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Step 0: q (B, nh, T, d), k/v (B, nkv, T, d) -> (B, nh, T, d), causal."""
        self.prefix_kv = (repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep))
        return F.scaled_dot_product_attention(q, *self.prefix_kv, is_causal=True,
                                              scale=self.scale)

    def chain(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
              ) -> torch.Tensor:
        """Step i ≥ 1 at flat positions ``rows`` (N,): q (1, nh, N, d), k/v (1, nkv, N, d),
        as the drafter lays out N rows run as one sequence -> (1, nh, N, d)."""
        if self.prefix_kv is None:
            raise RuntimeError("ChainAttention.prefix (step 0) must run before the chain")
        if self.sink_prefix is None:
            self.sink_prefix = prefix_with_sink(*self.prefix_kv)

        def as_rows(x: torch.Tensor) -> torch.Tensor:  # (1, heads, N, d) -> (N, h, d)
            return repeat_kv(x, self.n_rep)[0].transpose(0, 1)

        self.chain_k.append(as_rows(k))
        self.chain_v.append(as_rows(v))
        out = gathered_chain_attention(q[0].transpose(0, 1), rows, self.sink_prefix,
                                       self.chain_k, self.chain_v, self.scale)
        return out.transpose(0, 1)[None]

    def keep(self, index: torch.Tensor) -> None:
        """Keep the chain keys of rows ``index`` (positions in the current rows) only."""
        self.chain_k = [k.index_select(0, index) for k in self.chain_k]
        self.chain_v = [v.index_select(0, index) for v in self.chain_v]
