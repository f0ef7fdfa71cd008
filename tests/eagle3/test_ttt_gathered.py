"""Gathered TTT steps: steps i ≥ 1 run only at the positions some step j ≥ i counts, and give
the same loss, metrics and gradients as running every step at every position."""

from __future__ import annotations

import pytest
import torch

from pipeline.eagle3.chain_attention import gathered_chain_attention, prefix_with_sink
from pipeline.eagle3.reference import masked_chain_attention
from pipeline.eagle3.ttt import needed_positions, ttt_chain, ttt_hidden_states, ttt_loss
from pipeline.eagle3.ttt_batch import TTTBatch
from tests.eagle3.helpers import random_batch, tiny_drafter

DEPTH = 5


def ragged_batch(model, lengths: list[int], seed: int) -> TTTBatch:
    """Random batch whose gates differ from step to step and from row to row."""
    batch = random_batch(model, lengths, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch.loss_mask &= torch.rand(batch.loss_mask.shape, generator=g) < 0.6
    return batch


def step_gates(model, batch: TTTBatch, depth: int) -> list[torch.Tensor]:
    """gate_i (B, n_i), written out independently of ``ttt_loss``: step i at position t
    predicts x_{t+2+i} (trained, real) from the teacher at t+1+i (argmax in the draft vocab)."""
    t = batch.input_ids.shape[1]
    trained = batch.loss_mask & batch.attention_mask
    draftable = model.t2d[batch.target_argmax]
    return [trained[:, 2 + i:] & draftable[:, 1 + i:t - 1] for i in range(depth)]


def all_positions(batch: TTTBatch, depth: int) -> list[torch.Tensor]:
    return [torch.ones_like(batch.loss_mask)] * depth


def loss_and_grads(model, batch: TTTBatch, needs=None):
    model.zero_grad(set_to_none=True)
    loss, metrics = ttt_loss(model, batch, DEPTH, needs=needs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), metrics, grads


def assert_same_loss_and_grads(a, b) -> None:
    """Loss, metrics and every gradient equal to fp32 rounding: relative 1e-6, and for
    gradients within 2e-6 of their largest element (summation order differs with the CPU's
    SIMD width: 8.9e-7 · max seen on one Xeon, a few ulps; a wrong gather is far off)."""
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = a, b
    assert metrics_a.count == metrics_b.count
    assert metrics_a.accuracy == metrics_b.accuracy
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=0)
    assert metrics_a.step_loss == pytest.approx(metrics_b.step_loss, rel=1e-6, abs=0)
    for name, g in grads_a.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(g, grads_b[name], rtol=1e-6, atol=2e-6 * scale,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.parametrize("lengths, seed", [([13, 9, 4, 11], 21), ([16], 22), ([7, 2, 1], 23)])
def test_gathered_steps_give_the_full_loss_and_gradients(lengths, seed):
    model = tiny_drafter(seed)
    batch = ragged_batch(model, lengths, seed)
    gathered = loss_and_grads(model, batch)
    full = loss_and_grads(model, batch, needs=all_positions(batch, DEPTH))
    assert sum(gathered[1].count) > 0
    assert all(g.abs().sum() > 0 for g in gathered[2].values())
    assert_same_loss_and_grads(gathered, full)


def test_needed_positions_are_the_or_of_later_gates():
    model = tiny_drafter(24)
    batch = ragged_batch(model, [13, 9, 4, 11], 24)
    gates = step_gates(model, batch, DEPTH)
    t = batch.input_ids.shape[1]
    needs = needed_positions(gates, t)
    for i in range(DEPTH):
        for b in range(len(gates[i])):
            for pos in range(t):
                later = any(pos < g.shape[1] and bool(g[b, pos]) for g in gates[i:])
                assert bool(needs[i][b, pos]) == later, (i, b, pos)
    # The case is not trivial: steps skip positions, and some positions run at step i only
    # because a later step counts them.
    assert all((~n).any() for n in needs)
    assert any((n[:, :g.shape[1]] & ~g).any() for n, g in zip(needs, gates, strict=True))


def test_gathered_hidden_states_equal_the_full_ones_at_their_rows():
    model = tiny_drafter(25)
    batch = ragged_batch(model, [12, 8, 10], 25)
    needs = needed_positions(step_gates(model, batch, DEPTH), batch.input_ids.shape[1])
    b, t = batch.input_ids.shape
    with torch.no_grad():
        full = list(ttt_hidden_states(model, batch.input_ids, batch.aux_hidden, DEPTH))
        chain = list(ttt_chain(model, batch.input_ids, batch.aux_hidden, DEPTH, needs=needs))
    for i, ((rows, hidden), ref) in enumerate(zip(chain, full, strict=True)):
        expect = torch.arange(b * t) if i == 0 else needs[i].reshape(-1).nonzero().squeeze(1)
        assert torch.equal(rows, expect), i
        ref = ref.reshape(b * t, -1)[rows]
        torch.testing.assert_close(hidden, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item(),
                                   msg=lambda m, i=i: f"step {i}: {m}")
    assert len(chain[-1][0]) < b * t // 2  # the last steps run at a fraction of the rows


def test_dropping_a_needed_position_is_caught():
    """The comparison above has teeth: a need mask without a position that only a LATER
    step counts (so the step itself does not) changes the loss and gradients."""
    model = tiny_drafter(26)
    batch = ragged_batch(model, [13, 9, 4, 11], 26)
    gates = step_gates(model, batch, DEPTH)
    needs = needed_positions(gates, batch.input_ids.shape[1])
    # A position needed at step 1 although step 1 does not count it.
    only_later = needs[1][:, :gates[1].shape[1]] & ~gates[1]
    b, pos = (int(x) for x in only_later.nonzero()[0])
    wrong = [n.clone() for n in needs]
    wrong[1][b, pos] = False
    full = loss_and_grads(model, batch, needs=all_positions(batch, DEPTH))
    assert_same_loss_and_grads(loss_and_grads(model, batch, needs=needs), full)
    dropped = loss_and_grads(model, batch, needs=wrong)
    with pytest.raises(AssertionError):
        assert_same_loss_and_grads(dropped, full)
    # Not only the counts: the loss value and the gradients move too.
    assert abs(dropped[0].item() - full[0].item()) > 1e-4 * abs(full[0].item())
    assert any(not torch.allclose(dropped[2][name], g, rtol=1e-4, atol=1e-6)
               for name, g in full[2].items())


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_gathered_attention_equals_naive_masked_softmax(chunk):
    """A subset of query rows, split into chunks (of one sequence each), sees exactly what
    the full attention shows those rows: values and gradients."""
    g = torch.Generator().manual_seed(chunk)
    b, nh, t, d, steps = 2, 3, 11, 8, 3
    shape = (b, nh, t, d)
    leaves = [(2.0 * torch.randn(shape, generator=g)).requires_grad_()
              for _ in range(3 + 2 * steps)]
    q, pk, pv, rest = leaves[0], leaves[1], leaves[2], leaves[3:]
    ck, cv = rest[:steps], rest[steps:]
    keep = torch.rand(b * t, generator=g) < 0.6
    keep[t - 1] = keep[t] = True  # runs that end and start at a sequence boundary
    rows = keep.nonzero().squeeze(1)
    upstream = torch.randn(len(rows), nh, d, generator=g)

    def as_rows(x):  # (B, h, T, d) -> (N, h, d) at ``rows``
        return x.transpose(1, 2).reshape(b * t, nh, d)[rows]

    fast = gathered_chain_attention(as_rows(q), rows, prefix_with_sink(pk, pv),
                                    [as_rows(k) for k in ck], [as_rows(v) for v in cv],
                                    0.35, chunk=chunk)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), leaves)
    slow = as_rows(masked_chain_attention(q, pk, pv, ck, cv, scale=0.35))
    slow_grads = torch.autograd.grad((slow * upstream).sum(), leaves)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for a, ref in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-5)
    # Unselected queries get no gradient; their chain keys neither.
    dropped = ~keep.view(b, t)
    assert (fast_grads[0].transpose(1, 2)[dropped] == 0).all()
    assert (fast_grads[3].transpose(1, 2)[dropped] == 0).all()
