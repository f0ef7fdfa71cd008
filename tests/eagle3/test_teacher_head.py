"""Teacher logits exactly as the target computes them: soft-capping and scaling after the head.

Each case builds a tiny random model of the family with transformers and compares the
teacher (``teacher_targets`` on the model's post-norm last hidden state and its head weight,
with ``LogitHead.of(config)``) with the logits of the model's own forward pass.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.eagle3.ttt_batch import PLAIN_HEAD, LogitHead, teacher_targets

VOCAB, HIDDEN = 96, 32
SHAPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64)


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**SHAPE, final_logit_softcapping=2.0,
                                          sliding_window=16))


def cohere():
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(**SHAPE, logit_scale=0.25))


def granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(**SHAPE, logits_scaling=4.0))


@pytest.mark.parametrize("build", [gemma2, cohere, granite])
def test_the_teacher_equals_the_models_own_logits(build):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state[0]  # (T, H) post-norm
        want = model(input_ids=ids).logits[0]  # (T, V)
    head = LogitHead.of(model.config.to_dict())
    assert head != PLAIN_HEAD
    every = torch.ones(VOCAB, dtype=torch.bool)
    logits, argmax = teacher_targets(final, model.lm_head.weight, every, head=head,
                                     chunk_size=40)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax, want.argmax(-1))
    plain, _ = teacher_targets(final, model.lm_head.weight, every)
    assert not torch.allclose(plain, want, atol=1e-3)  # the plain matmul is not the teacher


def test_a_plain_config_has_a_plain_head():
    assert LogitHead.of({"vocab_size": 10}) == PLAIN_HEAD
    assert LogitHead.of({"final_logit_softcapping": None, "logit_scale": None}) == PLAIN_HEAD
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        for bad in (-30.0, 0, True, "30"):
            with pytest.raises(ValueError, match=f"{key} .* is not a positive number"):
                LogitHead.of({key: bad})
