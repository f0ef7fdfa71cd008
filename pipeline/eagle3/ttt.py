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
  merged exactly (:mod:`pipeline.eagle3.chain_attention`). Batches and teacher targets:
  :mod:`pipeline.eagle3.ttt_batch`.
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

import torch
import torch.nn.functional as F

from pipeline.attention_kernels import shape_stable
from pipeline.eagle3.chain_attention import ChainAttention
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.ttt_batch import TTTBatch

DEFAULT_DEPTH = 7
DEFAULT_DECAY = 0.8


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
    position t + i, with hidden fc(f_t) for i = 0 and h^{i-1}_t after (normed by the final
    norm for EAGLE 3.1's ``norm_output``: :meth:`~.model.Eagle3Drafter.feedback`).

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
        hidden = model.step(tokens[None], model.feedback(hidden)[None], (rows % t + i)[None],
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
    with shape_stable():  # the chain runs as this loop draws its steps
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


class TTTObjective(torch.nn.Module):
    """The drafter with its TTT loss as ``forward``, so DeepSpeed's engine runs the loss."""

    def __init__(self, drafter: Eagle3Drafter, depth: int, decay: float):
        super().__init__()
        self.drafter = drafter
        self.depth = depth
        self.decay = decay

    def forward(self, batch: TTTBatch) -> tuple[torch.Tensor, TTTMetrics]:
        return ttt_loss(self.drafter, batch, self.depth, decay=self.decay)
