"""Training-time test (TTT): the parallel forward of a K-step draft chain and its loss.

Training entry point: :func:`ttt_loss` ``(model, batch, depth=7) -> (loss, metrics)``.

Alignment (sequence x_0..x_{T-1}; ``loss_mask`` m_t says x_t is trained on; aux features f_t
see tokens ≤ t; teacher logits L_t = target_lm_head(final_hidden_t) predict x_{t+1}).
The chain that starts at position t, at step i = 0..K-1:

    hidden in   fc(f_t) for i = 0, else h^{i-1}_t (the draft's own un-normed output)
    token in    x_{t+1+i}                      (tokens shifted by 1 + i)
    RoPE pos    t + i
    attends to  step-0 keys at positions 0..t (causal) + keys of steps 1..i at position t
    predicts    x_{t+2+i}: soft target softmax(L_{t+1+i}[t2d]), teacher argmax a_{t+1+i}
    counted iff m_{t+2+i} (the PREDICTED token is trained on) and t2d[a_{t+1+i}]
                and t + 2 + i < T

In tensors, step i uses positions t < n_i = T - 2 - i and pairs
``logits_i[:, :n]`` with ``L[:, 1+i : T-1]``, ``a[:, 1+i : T-1]`` and ``m[:, 2+i : T]``.
Gating by m_{t+2+i} rather than m_t (SpecForge/EAGLE) trains the first two response tokens:
a response starting at r is predicted first at t = r - 2, step 0.

Invariants:

- The logits of step i at position t equal those of running the drafter autoregressively
  with a KV cache for i steps from position t (:mod:`pipeline.eagle3.drafting`; tested).
- Attention never materialises a (B, heads, T, T) score tensor: the causal prefix goes
  through ``scaled_dot_product_attention`` (flash / memory-efficient kernels) and the ≤ K-1
  chain keys at the same position are per-position dot products; the two softmax parts are
  merged exactly (see :func:`gathered_chain_attention`).
- The loss computes only what it reads: steps i ≥ 1 run at the positions some step j ≥ i
  counts (:func:`needed_positions`; a chain's hidden state at t feeds only its own next
  step at t), ``lm_head`` at the counted ones. Same loss and gradients as running every
  step everywhere (tested).
- Loss per step is the mean soft cross-entropy over its counted positions; the total is
  ``Σ_i decay^i · loss_i`` (decay 0.8). Batches are right-padded; every sequence starts at
  position 0 (no packing).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from pipeline.eagle3.model import Eagle3Drafter, repeat_kv

DEFAULT_DEPTH = 7
DEFAULT_DECAY = 0.8
DEFAULT_TEACHER_CHUNK = 8192
QUERY_CHUNK = 64  # queries per attention call of a gathered chain step


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
            chunk_size: int = DEFAULT_TEACHER_CHUNK) -> TTTBatch:
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
                                                 rows, chunk_size=chunk_size)
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
                  rows: torch.Tensor, *, chunk_size: int = DEFAULT_TEACHER_CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`teacher_targets` for the ``rows`` (B, T) of ``final_hidden`` (B, T, H) only.

    Returns ``(logits (B, T, Vd) fp32, argmax (B, T) int64)``, zeros outside ``rows``.
    """
    b, t = rows.shape
    logits = torch.zeros(b, t, int(t2d.sum()), dtype=torch.float32, device=final_hidden.device)
    argmax = torch.zeros(b, t, dtype=torch.int64, device=final_hidden.device)
    logits[rows], argmax[rows] = teacher_targets(final_hidden[rows], lm_head_weight, t2d,
                                                 chunk_size=chunk_size)
    return logits, argmax


@torch.no_grad()
def teacher_targets(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                    t2d: torch.Tensor, *, chunk_size: int = DEFAULT_TEACHER_CHUNK
                    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        logits = h @ lm_head_weight[c0:c0 + chunk_size].float().T  # (N, C)
        value, index = logits.max(dim=-1)
        better = value > best  # strict: an earlier chunk keeps a tie
        best = torch.where(better, value, best)
        arg = torch.where(better, index + c0, arg)
        keep = t2d[c0:c0 + chunk_size]
        k = int(keep.sum())
        out[:, col:col + k] = logits[:, keep]
        col += k
    return out.view(*lead, draft_vocab), arg.view(*lead)


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


def shift_left(x: torch.Tensor, s: int, fill: int) -> torch.Tensor:
    """(B, T) -> (B, T) with ``y[:, t] = x[:, t + s]``, ``fill`` where ``t + s >= T``."""
    y = torch.full_like(x, fill)
    if s < x.shape[1]:
        y[:, :x.shape[1] - s] = x[:, s:]
    return y


def needed_positions(gates: Sequence[torch.Tensor], seq_len: int) -> list[torch.Tensor]:
    """need_i (B, T) = OR_{j ≥ i} gate_j: the positions step i must run at.

    ``gates[j]`` (B, n_j ≤ T) says step j at position t is counted by the loss. A step's
    output at t feeds only step i+1 at t (and step 0's keys, which run everywhere anyway),
    so step i matters at t iff some step j ≥ i is counted there. need_i shrinks with i.
    """
    need = torch.zeros(gates[0].shape[0], seq_len, dtype=torch.bool, device=gates[0].device)
    needs = []
    for gate in reversed(gates):
        need = need.clone()
        need[:, :gate.shape[1]] |= gate
        needs.append(need)
    return needs[::-1]


def ttt_chain(model: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
              depth: int = DEFAULT_DEPTH, *, needs: Sequence[torch.Tensor] | None = None,
              pad_token_id: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(rows, h^i)`` for steps i = 0..depth-1: the flat positions ``rows`` (N_i,)
    = b·T + t (increasing) the step ran at, and its un-normed output there, (N_i, H).

    ``input_ids`` (B, T) are the sequence tokens x_t (unshifted); ``aux_hidden`` (B, T, 3·Ht)
    the features f_t. Step i feeds token x_{t+1+i} (``pad_token_id`` past the end) at RoPE
    position t + i, with hidden fc(f_t) for i = 0 and h^{i-1}_t after.

    Step 0 runs at every position: its keys are every later query's prefix. Step i ≥ 1 runs
    at the positions where ``needs[i]`` (B, T) bool is set (``needs[0]`` is not read), and
    that step 0..i-1 ran at (h^{i-1}_t is its input); ``None``: everywhere. Skipping a
    position changes nothing at the others (its chain keys are only seen by itself), so
    with ``needs`` from :func:`needed_positions` every counted logit is as with ``None``,
    and the per-row work (norms, projections, MLP) shrinks to the rows the loss reads.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    b, t = input_ids.shape
    cfg = model.config
    attend = ChainAttention(cfg.num_attention_heads // cfg.num_key_value_heads, model.scale)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)  # (B, T)
    hidden = model.step(shift_left(input_ids, 1, pad_token_id), model.project(aux_hidden),
                        positions, attend.prefix)  # (B, T, H)
    rows = torch.arange(b * t, device=input_ids.device)
    hidden = hidden.reshape(b * t, -1)
    yield rows, hidden
    for i in range(1, depth):
        if needs is not None:
            index = needs[i].reshape(-1)[rows].nonzero().squeeze(1)  # kept rows' places
            if len(index) < len(rows):
                rows, hidden = rows[index], hidden.index_select(0, index)
                attend.keep(index)
        tokens = shift_left(input_ids, 1 + i, pad_token_id).reshape(-1)[rows]  # x_{t+1+i}
        hidden = model.step(tokens[None], hidden[None], (rows % t + i)[None],
                            functools.partial(attend.chain, rows=rows))[0]  # (N_i, H)
        yield rows, hidden


def ttt_hidden_states(model: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
                      depth: int = DEFAULT_DEPTH, *, pad_token_id: int = 0
                      ) -> Iterator[torch.Tensor]:
    """Yield h^i (B, T, H), the un-normed output of step i = 0..depth-1 at every position
    (:func:`ttt_chain` run everywhere)."""
    b, t = input_ids.shape
    for _, hidden in ttt_chain(model, input_ids, aux_hidden, depth, pad_token_id=pad_token_id):
        yield hidden.view(b, t, -1)


def ttt_logits(model: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
               depth: int = DEFAULT_DEPTH, *, pad_token_id: int = 0) -> list[torch.Tensor]:
    """Draft logits (B, T, Vd) of every step (for tests and evaluation)."""
    return [model.compute_logits(h) for h in
            ttt_hidden_states(model, input_ids, aux_hidden, depth, pad_token_id=pad_token_id)]


# -- the loss ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TTTMetrics:
    """Per-step statistics of one batch (floats, detached)."""

    loss: float  # the weighted total
    step_loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)  # over counted positions
    count: list[int] = field(default_factory=list)  # counted positions per step
    sim_accept_length: float = 0.0  # Σ_k Π_{j≤k} accuracy_j

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        out = {f"{prefix}loss": self.loss, f"{prefix}sim_accept_length": self.sim_accept_length}
        for i, (lo, acc, n) in enumerate(zip(self.step_loss, self.accuracy, self.count,
                                             strict=True)):
            out[f"{prefix}loss_{i}"] = lo
            out[f"{prefix}acc_{i}"] = acc
            out[f"{prefix}count_{i}"] = float(n)
        return out


def simulated_accept_length(accuracy: Sequence[float]) -> float:
    """Σ_k Π_{j≤k} acc_j: expected accepted drafts if step k is right w.p. acc_k."""
    total, run = 0.0, 1.0
    for acc in accuracy:
        run *= acc
        total += run
    return total


def ttt_loss(model: Eagle3Drafter, batch: TTTBatch, depth: int = DEFAULT_DEPTH, *,
             decay: float = DEFAULT_DECAY, pad_token_id: int = 0,
             needs: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, TTTMetrics]:
    """The TTT training loss ``Σ_i decay^i · loss_i`` and its metrics (see module docstring).

    Only what the loss reads is computed: steps i ≥ 1 run at the positions some step j ≥ i
    counts (:func:`needed_positions`; about half of all positions in chat data), and
    ``norm``, ``lm_head`` and the soft cross-entropy at the counted positions of each step
    (``lm_head`` is most of a step's FLOPs); the teacher softmax runs once, on the rows
    some step reads.

    ``needs``: the positions each step runs at, as for :func:`ttt_chain`, instead of
    :func:`needed_positions` -- all-True masks give the full computation, for tests and
    comparisons. A position missing there is not counted, whatever its gate says.
    """
    batch.validate(model)
    _, t = batch.input_ids.shape
    with torch.no_grad():
        draftable = model.t2d[batch.target_argmax]  # (B, T): teacher argmax in draft vocab
        trained = batch.loss_mask & batch.real  # (B, T): x_t is a trained, real token
        gates = [trained[:, 2 + i:] & draftable[:, 1 + i:t - 1] for i in range(depth)]
        # gates[i] (B, n_i), n_i = T - 2 - i: step i at position t is counted
        teacher = torch.zeros_like(trained)  # (B, T): teacher rows some step reads
        for i, gate in enumerate(gates):
            teacher[:, 1 + i:t - 1] |= gate
        row_of = torch.cumsum(teacher.flatten(), 0) - 1  # (B·T,) compact teacher index
        log_p = F.log_softmax(batch.target_logits_draft[teacher].float(), dim=-1)  # (R, Vd)
        p = log_p.exp()
        if needs is None:
            needs = needed_positions(gates, t)
        flat_gates = [F.pad(gate, (0, t - gate.shape[1])).reshape(-1) for gate in gates]
    steps = ttt_chain(model, batch.input_ids, batch.aux_hidden, depth, needs=needs,
                      pad_token_id=pad_token_id)
    # The counted rows of every step, then ONE norm + lm_head over all of them: the chain
    # needs each step's hidden state, never its logits, and one large matmul (forward and
    # weight gradient) runs faster than ``depth`` small ones.
    hidden_rows, counted = [], []  # counted[i]: flat positions b·T + t, in (b, t) order
    for (rows, hidden), gate in zip(steps, flat_gates, strict=True):
        keep = gate[rows]  # (N_i,) bool: the step's rows the loss counts
        hidden_rows.append(hidden[keep])
        counted.append(rows[keep])
    logits = model.compute_logits(torch.cat(hidden_rows)).float()  # (Σ N_i, Vd)
    total = batch.aux_hidden.new_zeros((), dtype=torch.float32)
    step_losses, sums, counts = [], [], []
    for i, (logits_i, at) in enumerate(zip(logits.split([len(c) for c in counted]), counted,
                                           strict=True)):
        # logits_i (N_i, Vd) at counted positions t, predicting x_{t+2+i}; the teacher is at
        # t+1+i, in the same sequence (t + 2 + i < T).
        teacher_at = at + 1 + i
        p_i = p[row_of[teacher_at]]  # (N_i, Vd)
        argmax = batch.target_argmax.reshape(-1)[teacher_at]  # (N_i,)
        ce = soft_cross_entropy(logits_i, p_i)  # (N_i,)
        count = len(at)
        loss_i = ce.sum() / max(count, 1)
        total = total + decay ** i * loss_i
        with torch.no_grad():
            correct = model.to_target_ids(logits_i.argmax(-1)) == argmax
            step_losses.append(loss_i.detach())
            sums.append(correct.sum())
            counts.append(count)
    correct_l = torch.stack(sums).tolist()
    accuracy = [c / n if n else 0.0 for c, n in zip(correct_l, counts, strict=True)]
    metrics = TTTMetrics(loss=float(total.detach()),
                         step_loss=torch.stack(step_losses).tolist(), accuracy=accuracy,
                         count=counts, sim_accept_length=simulated_accept_length(accuracy))
    return total, metrics


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(N, V) logits, (N, V) target probabilities summing to 1 -> (N,) ``-Σ p·log_softmax``.

    Written as ``logsumexp(x) - <p, x>`` (equal when Σp = 1): no (N, V) log-softmax is kept
    for backward. The backward is written out (:class:`_SoftCrossEntropy`): autograd's
    ``logsumexp`` and ``bmm`` backwards cost five (N, V) passes plus a per-row outer-product
    ``bmm``, three times the four in-place passes of ``(softmax(x) - p) · g``. ``p`` is a
    fixed target: it gets no gradient.
    """
    if p.requires_grad:
        raise ValueError("soft_cross_entropy: the target p must not require grad")
    return _SoftCrossEntropy.apply(logits, p)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        ctx.save_for_backward(logits, p, lse)
        return lse - torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).view(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, p, lse = ctx.saved_tensors
        out = torch.sub(logits, lse[:, None])  # (N, V), then in place: softmax - p, · grad
        out.exp_().sub_(p).mul_(grad[:, None])
        return out, None
