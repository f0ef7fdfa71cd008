"""The hf capture backend against transformers' own ``output_hidden_states`` (exact, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.capture.hf import HFCaptureBackend, hf_backend_for_step
from pipeline.eagle3.config import default_aux_layer_ids
from pipeline.snapshot.policy import publish_policy
from pipeline.storage import Storage
from tests.capture.helpers import random_batch, tiny_llama


def padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T) and attention mask (B, T), built independently of the backend."""
    t = max(map(len, batch))
    ids = torch.zeros((len(batch), t), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def reference(model, batch):
    ids, mask = padded(batch)
    with torch.no_grad():
        return model(ids, attention_mask=mask, output_hidden_states=True).hidden_states


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def test_hf_last_hidden_state_is_post_norm(model):
    """Verified, not assumed: in transformers 5 ``hidden_states[-1]`` is after the norm."""
    captured = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    try:
        hs = reference(model, random_batch())
    finally:
        handle.remove()
    pre_norm = captured[0]  # output of the last decoder layer, (B, T, H)
    with torch.no_grad():
        assert torch.equal(hs[-1], model.model.norm(pre_norm))
    assert not torch.allclose(hs[-1], pre_norm)
    assert len(hs) == model.config.num_hidden_layers + 1


@pytest.mark.parametrize("aux_ids", [None, (0, 3, 4), (0, 1, 2)])
def test_states_equal_output_hidden_states_exactly(model, aux_ids):
    batch = random_batch()
    backend = HFCaptureBackend(model, aux_layer_ids=aux_ids)
    ids = aux_ids or default_aux_layer_ids(6)
    assert backend.aux_layer_ids == tuple(ids) and backend.hidden_size == 64
    states = backend.capture(batch)
    hs = reference(model, batch)
    assert len(states) == len(batch)
    for i, (sample, st) in enumerate(zip(batch, states, strict=True)):
        t = len(sample)
        want_aux = torch.cat([hs[layer + 1][i, :t] for layer in ids], dim=-1)  # (T, 3H)
        assert st.aux_hidden.shape == (t, 3 * 64) and st.final_hidden.shape == (t, 64)
        assert st.aux_hidden.dtype == torch.float32
        assert torch.equal(st.aux_hidden, want_aux)
        assert torch.equal(st.final_hidden, hs[-1][i, :t])


def test_padding_does_not_leak_into_real_tokens(model):
    """Each sample run alone, unpadded, gives the same states up to float reassociation."""
    batch = random_batch()
    states = HFCaptureBackend(model, aux_layer_ids=(0, 3, 4)).capture(batch)
    for sample, st in zip(batch, states, strict=True):
        hs = reference(model, [sample])
        want = torch.cat([hs[i + 1][0] for i in (0, 3, 4)], dim=-1)
        torch.testing.assert_close(st.aux_hidden, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st.final_hidden, hs[-1][0], rtol=1e-5, atol=1e-5)


def test_token_budget_splits_batches_and_each_split_is_exact(model):
    batch = random_batch((4, 4, 8, 3, 8, 2))
    calls = []
    handle = model.model.embed_tokens.register_forward_hook(
        lambda _m, args, _o: calls.append(tuple(args[0].shape)))
    try:
        states = HFCaptureBackend(model, token_budget=16).capture(batch)
    finally:
        handle.remove()
    # consecutive groups with B * T_max <= 16: [4, 4] [8, 3] [8, 2]
    assert calls == [(2, 4), (2, 8), (2, 8)]
    start = 0
    for b, _ in calls:
        group = batch[start:start + b]
        hs = reference(model, group)
        for j, sample in enumerate(group):
            assert torch.equal(states[start + j].final_hidden, hs[-1][j, : len(sample)])
        start += b


def test_lm_head_is_never_run(model):
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        HFCaptureBackend(model).capture(random_batch())
    finally:
        handle.remove()
    assert calls == []


def test_bf16_output_is_the_rounded_fp32_state(model):
    batch = random_batch()
    full = HFCaptureBackend(model).capture(batch)
    half = HFCaptureBackend(model, output_dtype=torch.bfloat16).capture(batch)
    for a, b in zip(full, half, strict=True):
        assert b.aux_hidden.dtype == torch.bfloat16
        assert torch.equal(a.aux_hidden.to(torch.bfloat16), b.aux_hidden)
        assert torch.equal(a.final_hidden.to(torch.bfloat16), b.final_hidden)


def test_invalid_aux_layer_ids_are_refused(model):
    """Ids every engine can capture: id 5, the last layer's output, is not captured by
    SGLang's Llama (pipeline/eagle3/aux_layers.py); a repeated or unordered id is not
    captured twice or out of order by any engine."""
    with pytest.raises(ValueError, match=r"must be in \[0, 4\]; id 5"):
        HFCaptureBackend(model, aux_layer_ids=(1, 2, 5))
    with pytest.raises(ValueError, match="distinct and ascending"):
        HFCaptureBackend(model, aux_layer_ids=(4, 1, 2))
    with pytest.raises(ValueError, match="3-layer target has no three distinct"):
        HFCaptureBackend(tiny_llama(layers=3))
    with pytest.raises(ValueError, match="empty sequence"):
        HFCaptureBackend(model).capture([[1, 2], []])


def test_backend_for_a_step_loads_its_published_policy(model, tmp_path):
    storage = Storage(str(tmp_path / "storage"))
    model.save_pretrained(tmp_path / "policy")
    publish_policy(storage, 7, tmp_path / "policy")
    batch = random_batch()
    want = HFCaptureBackend(model).capture(batch)
    with hf_backend_for_step(storage, 7) as backend:
        got = backend.capture(batch)
        assert backend.describe()["model_dtype"] == "float32"
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.aux_hidden, b.aux_hidden)
        assert torch.equal(a.final_hidden, b.final_hidden)
    with pytest.raises(FileNotFoundError):
        with hf_backend_for_step(storage, 8):
            pass


def test_the_device_is_part_of_a_gpu_backends_identity_only():
    """CPU steps committed before the device was recorded keep their fingerprint; a step
    captured on another device type gets another fingerprint, so it never mixes shards."""
    on_cpu = HFCaptureBackend(tiny_llama(layers=4)).describe()
    elsewhere = HFCaptureBackend(tiny_llama(layers=4), device="meta").describe()
    assert "device" not in on_cpu and elsewhere == {**on_cpu, "device": "meta"}
