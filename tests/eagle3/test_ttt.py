"""TTT proofs: parallel chain == autoregressive drafting, loss == slow reference, gradients,
mask gating of the first response tokens, memory-safe attention, teacher targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.eagle3.chain_attention import gathered_chain_attention, prefix_with_sink
from pipeline.eagle3.drafting import draft_reference_logits
from pipeline.eagle3.model import EXPORTED_NAMES
from pipeline.eagle3.reference import masked_chain_attention, reference_ttt_loss
from pipeline.eagle3.ttt import simulated_accept_length, ttt_logits, ttt_loss
from pipeline.eagle3.ttt_batch import TTTBatch, collate, teacher_rows, teacher_targets
from tests.eagle3.helpers import random_batch, tiny_drafter, tiny_target_config


def prefix_and_chain_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                               chain_k: Sequence[torch.Tensor], chain_v: Sequence[torch.Tensor],
                               scale: float) -> torch.Tensor:
    """:func:`gathered_chain_attention` with every position a query, in (B, h, T, d) layout:
    query t sees prefix keys 0..t and the i chain keys at t."""
    b, nh, t, d = q.shape

    def as_rows(x: torch.Tensor) -> torch.Tensor:  # (B, h, T, d) -> (B·T, h, d)
        return x.transpose(1, 2).reshape(b * t, nh, d)

    rows = torch.arange(b * t, device=q.device)
    out = gathered_chain_attention(as_rows(q), rows, prefix_with_sink(prefix_k, prefix_v),
                                   [as_rows(k) for k in chain_k],
                                   [as_rows(v) for v in chain_v], scale)
    return out.view(b, t, nh, d).transpose(1, 2)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 50000.0}


# -- (1) parallel TTT == autoregressive drafting with a KV cache ----------------------------
@pytest.mark.parametrize("target_overrides, lengths, depth", [
    ({}, [12, 5, 1, 2], 7),  # GQA 4/2, right padding, lengths 1 and 2 (no trainable position)
    ({"num_key_value_heads": 4, "rope_parameters": LLAMA3_ROPE}, [9], 5),  # MHA, llama3 rope
])
def test_ttt_logits_equal_autoregressive_drafting(target_overrides, lengths, depth):
    model = tiny_drafter(3, target=tiny_target_config(**target_overrides))
    batch = random_batch(model, lengths, seed=4)
    with torch.no_grad():
        parallel = ttt_logits(model, batch.input_ids, batch.aux_hidden, depth)  # depth×(B,T,Vd)
    for b, n in enumerate(lengths):
        ref = draft_reference_logits(model, batch.input_ids[b, :n], batch.aux_hidden[b, :n],
                                     depth)  # (depth, n, Vd)
        for i in range(depth):
            torch.testing.assert_close(parallel[i][b, :n], ref[i], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, b=b, i=i: f"row {b} step {i}: {m}")
    # The chain really changes with depth (otherwise equality above proves little).
    assert (parallel[1] - parallel[0]).abs().max() > 0.1


# -- (2) the loss == a slow, explicit reference --------------------------------------------
@pytest.mark.parametrize("lengths", [[11, 6], [3], [14]])
def test_loss_equals_slow_reference(lengths):
    depth = 4
    model = tiny_drafter(5)
    batch = random_batch(model, lengths, seed=6)
    with torch.no_grad():
        loss, metrics = ttt_loss(model, batch, depth)
    total, step_loss, acc, count = reference_ttt_loss(model, batch, depth)
    assert metrics.count == count
    assert loss.item() == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert metrics.step_loss == pytest.approx(step_loss, rel=1e-5, abs=1e-6)
    assert metrics.accuracy == pytest.approx(acc)
    assert metrics.sim_accept_length == pytest.approx(simulated_accept_length(acc))
    if max(lengths) > 3:
        assert count[0] > 0 and total > 0


def test_simulated_accept_length():
    assert simulated_accept_length([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert simulated_accept_length([1.0, 0.0, 1.0]) == 1.0


# -- (3) gradients reach exactly the trainable parameters -----------------------------------
def test_only_trainable_parameters_get_gradients():
    model = tiny_drafter(7)
    batch = random_batch(model, [10, 7], seed=8)
    loss, _ = ttt_loss(model, batch, depth=3)
    loss.backward()
    names = {name for name, _ in model.named_parameters()}
    assert names == set(EXPORTED_NAMES) - {"d2t", "t2d"}
    for name, p in model.named_parameters():
        assert p.requires_grad, name
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
    embed = model.embed_tokens.weight
    assert not embed.requires_grad and embed.grad is None
    assert all(p is not embed for p in model.parameters())


# -- (4) the first response tokens are trained ----------------------------------------------
def lag_gated_step0_loss(model, batch: TTTBatch) -> tuple[float, int]:
    """Counterfactual (SpecForge/EAGLE): position t gated by the mask AT t, not of x_{t+2}."""
    t = batch.input_ids.shape[1]
    n = t - 2
    logits = ttt_logits(model, batch.input_ids, batch.aux_hidden, 1)[0][:, :n]
    p = torch.softmax(batch.target_logits_draft[:, 1:1 + n], -1)
    gate = batch.loss_mask[:, :n] & model.t2d[batch.target_argmax[:, 1:1 + n]]
    ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
    return float((ce * gate).sum() / gate.sum().clamp(min=1)), int(gate.sum())


def test_first_response_tokens_are_trained_and_lag_gating_would_miss_them():
    t, r = 12, 5  # prompt x_0..x_4, response x_5..x_11
    model = tiny_drafter(9)
    batch = random_batch(model, [t], seed=10, response_start=r)
    batch.target_argmax = model.to_target_ids(batch.target_logits_draft.argmax(-1))
    step0 = lambda bt: ttt_loss(model, bt, depth=1)[1]  # noqa: E731

    def perturbed(index: int) -> TTTBatch:
        logits = batch.target_logits_draft.clone()
        logits[0, index] = logits[0, index].flip(-1) * 3.0  # new teacher distribution
        return replace(batch, target_logits_draft=logits)

    with torch.no_grad():
        base = step0(batch)
        # Tokens r..T-1 are predicted at positions r-2..T-3: T - r counted positions.
        assert base.count == [t - r]
        # x_r is predicted at position r-2 from the teacher at r-1; x_{r+1} from r.
        for teacher_index in (r - 1, r):
            assert step0(perturbed(teacher_index)).loss != pytest.approx(base.loss, abs=1e-6)
        # The teacher at r-2 predicts x_{r-1}, a prompt token: not trained.
        assert step0(perturbed(r - 2)).loss == pytest.approx(base.loss, abs=0)

        # The two-token lag would never train x_r and x_{r+1}.
        lag_loss, lag_count = lag_gated_step0_loss(model, batch)
        assert lag_count == t - r - 2
        for teacher_index in (r - 1, r):
            assert lag_gated_step0_loss(model, perturbed(teacher_index))[0] == lag_loss


# -- attention: exact, and never a (B, heads, T, T) tensor ----------------------------------
@pytest.mark.parametrize("t, steps", [(1, 1), (7, 1), (7, 3), (33, 6)])
def test_chain_attention_equals_naive_masked_softmax(t, steps):
    g = torch.Generator().manual_seed(t * 10 + steps)
    shape = (2, 3, t, 8)
    leaves = [(2.0 * torch.randn(shape, generator=g)).requires_grad_()
              for _ in range(3 + 2 * steps)]
    q, pk, pv, rest = leaves[0], leaves[1], leaves[2], leaves[3:]
    ck, cv = rest[:steps], rest[steps:]
    upstream = torch.randn(shape, generator=g)

    fast = prefix_and_chain_attention(q, pk, pv, ck, cv, scale=0.35)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), leaves)
    slow = masked_chain_attention(q, pk, pv, ck, cv, scale=0.35)
    slow_grads = torch.autograd.grad((slow * upstream).sum(), leaves)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for a, b in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_chain_attention_bf16_is_close():
    """bf16 error comparable to a bf16 SDPA kernel (inputs rounded the same for both)."""
    g = torch.Generator().manual_seed(0)
    shape = (1, 2, 40, 16)
    q, pk, pv, k1, k2, v1, v2 = ((3.0 * torch.randn(shape, generator=g)).bfloat16()
                                 for _ in range(7))
    ref = masked_chain_attention(*(x.float() for x in (q, pk, pv)), [k1.float(), k2.float()],
                                [v1.float(), v2.float()], scale=0.25)
    low = prefix_and_chain_attention(q, pk, pv, [k1, k2], [v1, v2], scale=0.25)
    assert low.dtype == torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    baseline = (sdpa(q, pk, pv, is_causal=True, scale=0.25).float()
                - sdpa(q.float(), pk.float(), pv.float(), is_causal=True, scale=0.25))
    # Within 1.5x of a plain bf16 kernel's own error (dropping the lo half of lse: ~2.3x).
    assert (low.float() - ref).abs().max() <= 1.5 * baseline.abs().max()


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns, and which ops ran."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_ttt_never_materialises_full_attention_scores():
    t = 384
    model = tiny_drafter(11)
    batch = random_batch(model, [t], seed=12)
    heads = model.config.num_attention_heads
    scores = heads * t * t  # one (1, heads, T, T) tensor
    with LargestTensor() as seen:
        loss, _ = ttt_loss(model, batch, depth=4)
        loss.backward()
    assert seen.largest < scores // 8, seen.largest
    assert any("scaled_dot_product" in op and "math" not in op for op in seen.ops)

    # The same probe catches a naive implementation (the check can fail).
    q = torch.randn(1, heads, t, 8, requires_grad=True)
    with LargestTensor() as naive:
        masked_chain_attention(q, q, q, [q], [q], 0.3).sum().backward()
    assert naive.largest >= scores


# -- teacher targets and batches ------------------------------------------------------------
@pytest.mark.parametrize("chunk", [5, 16, 48, 1000])
def test_teacher_targets_match_full_logits(chunk):
    g = torch.Generator().manual_seed(chunk)
    vocab, hidden = 48, 6
    # Small integers: every dot product is exact, so duplicated rows tie exactly.
    weight = torch.randint(-3, 4, (vocab, hidden), generator=g).float()
    weight[7] = weight[40] = 2.0  # rows 7 and 40 tie (across chunks): the smaller id wins
    final = torch.randint(0, 3, (3, 4, hidden), generator=g).float()
    t2d = torch.rand(vocab, generator=g) < 0.5
    logits, argmax = teacher_targets(final.bfloat16(), weight.bfloat16(), t2d, chunk_size=chunk)
    full = final @ weight.T
    assert logits.dtype == torch.float32 and logits.shape == (3, 4, int(t2d.sum()))
    torch.testing.assert_close(logits, full[..., t2d], rtol=0, atol=0)
    assert torch.equal(argmax, full.argmax(-1))
    assert (argmax == 7).any() and not (argmax == 40).any()


def test_collate_right_pads_and_matches_per_sample_teacher():
    model = tiny_drafter(13)
    cfg = model.config
    g = torch.Generator().manual_seed(14)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    samples = [SimpleNamespace(
        input_ids=torch.randint(0, cfg.vocab_size, (n,), generator=g, dtype=torch.int32),
        loss_mask=torch.rand(n, generator=g) < 0.5,
        aux_hidden=torch.randn(n, cfg.fc_in_features, generator=g).bfloat16(),
        final_hidden=torch.randn(n, cfg.hidden_size, generator=g).bfloat16()) for n in (5, 3)]
    batch = collate(samples, lm_head, model.t2d, pad_token_id=0, chunk_size=7)
    batch.validate(model)
    assert batch.input_ids.shape == (2, 5)
    assert batch.attention_mask.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert not batch.loss_mask[1, 3:].any()
    rows = teacher_rows(batch.loss_mask & batch.real)
    full_logits = torch.zeros_like(batch.target_logits_draft)
    full_argmax = torch.zeros_like(batch.target_argmax)
    for row, s in enumerate(samples):
        n = s.input_ids.shape[0]
        logits, argmax = teacher_targets(s.final_hidden, lm_head, model.t2d)
        full_logits[row, :n], full_argmax[row, :n] = logits, argmax
        # Row r is computed iff x_{r+1} is trained; the others are zeros.
        expect_rows = torch.zeros(5, dtype=torch.bool)
        expect_rows[:n - 1] = s.loss_mask[1:n]
        expect_rows[0] = False
        assert torch.equal(rows[row], expect_rows)
        torch.testing.assert_close(batch.target_logits_draft[row, rows[row]],
                                   logits[rows[row, :n]])
        assert torch.equal(batch.target_argmax[row, rows[row]], argmax[rows[row, :n]])
        assert not batch.target_logits_draft[row, ~rows[row]].any()
        assert torch.equal(batch.input_ids[row, :n], s.input_ids.long())
    assert rows.any() and (batch.real & ~rows).any()  # the case is not trivial
    # The loss reads only those rows: same loss and metrics as with the full teacher.
    full = replace(batch, target_logits_draft=full_logits, target_argmax=full_argmax)
    with torch.no_grad():
        loss, metrics = ttt_loss(model, batch, depth=3)
        full_loss, full_metrics = ttt_loss(model, full, depth=3)
    assert torch.isfinite(loss) and sum(metrics.count) > 0
    assert loss.item() == pytest.approx(full_loss.item(), rel=1e-6)
    assert metrics.step_loss == pytest.approx(full_metrics.step_loss, rel=1e-6)
    assert (metrics.count, metrics.accuracy) == (full_metrics.count, full_metrics.accuracy)


def test_validate_refuses_left_padding_and_bad_shapes():
    model = tiny_drafter(15)
    batch = random_batch(model, [6, 4], seed=16)
    left = batch.attention_mask.flip(-1)
    with pytest.raises(ValueError, match="right-padded"):
        ttt_loss(model, replace(batch, attention_mask=left), depth=1)
    with pytest.raises(ValueError, match="target_logits_draft"):
        ttt_loss(model, replace(batch, target_logits_draft=batch.target_logits_draft[..., :3]))
