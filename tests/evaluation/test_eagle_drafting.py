"""The engine's EAGLE-3 drafting against the reference (``pipeline.eagle3.drafting``).

Every proposal the engine asks of the drafter must equal what the reference gives: a KV cache
prefilled one position at a time with (fc(aux_s), x_{s+1}) over the verified sequence, with
aux features captured by the (independent) HF capture backend from a full forward pass, then
the draft path to the frontier node decoded token by token. This pins draft extend (features,
tokens, positions), the drafter's RoPE positions, and its tree attention; deliberately broken
variants must fail it.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.capture.hf import HFCaptureBackend
from pipeline.eagle3.drafting import KVCache, decode
from pipeline.eagle3.proposer import Eagle3Proposer
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine import evaluate
from tests.evaluation.conftest import AUX_LAYER_IDS

pytestmark = pytest.mark.integration


class Recording:
    """Wraps a drafter, recording each proposal with the verified context it came from."""

    def __init__(self, inner: Eagle3Proposer):
        self.inner, self.calls, self.context, self.prompt = inner, [], [], -1
        self.aux_layer_ids = inner.aux_layer_ids

    def reset(self, prompt_ids):
        self.context, self.prompt = [prompt_ids[0]], self.prompt + 1
        self.inner.reset(prompt_ids)

    def extend(self, next_tokens, aux):
        self.context += next_tokens.tolist()
        self.inner.extend(next_tokens, aux)

    def propose(self, tree, frontier, k):
        probs, ids = self.inner.propose(tree, frontier, k)
        self.calls.append((self.prompt, list(self.context),
                           [tree.path_tokens(n) for n in frontier], k, probs, ids))
        return probs, ids


class OffByOnePosition(Eagle3Proposer):
    @staticmethod
    def _node_position(committed: int, depth: int) -> int:
        return committed + depth


class MisalignedExtend(Eagle3Proposer):
    def extend(self, next_tokens, aux):  # pairs aux_{s-1} with x_{s+1}
        super().extend(next_tokens, torch.cat([aux[:1], aux[:-1]]))


class NoTreeMask(Eagle3Proposer):
    def _attend(self, q, keys, values, allowed):  # siblings and cousins become visible
        return super()._attend(q, keys, values, torch.ones_like(allowed))


@torch.inference_mode()
def mismatches(target, model, proposer_cls, prompts, params) -> int:
    recorder = Recording(proposer_cls(model))
    _, outputs = evaluate(target, recorder, prompts, params, max_new_tokens=12)
    capture = HFCaptureBackend(target, aux_layer_ids=AUX_LAYER_IDS)
    states = capture.capture([p + o for p, o in zip(prompts, outputs, strict=True)])
    references = []  # per prompt: (sequence, prefilled reference cache, step-0 outputs)
    for prompt, out, st in zip(prompts, outputs, states, strict=True):
        seq = prompt + out
        h0 = model.project(st.aux_hidden[None])[0]  # (T, H)
        cache, step0 = KVCache(), []
        for s in range(len(seq) - 1):
            step0.append(decode(model, cache, seq[s + 1], h0[s]))
        references.append((seq, cache, step0))
    bad = 0
    for prompt_index, context, paths, k, probs, ids in recorder.calls:
        seq, cache, step0 = references[prompt_index]
        assert seq[:len(context)] == context  # lossless, so a prefix of the output
        root = len(context) - 1
        for row, path in enumerate(paths):
            chain, hidden = cache.prefix(root), step0[root - 1]
            for token in path:
                hidden = decode(model, chain, token, hidden)
            ref = torch.softmax(model.compute_logits(hidden).float(), -1)
            ref_p, ref_i = torch.topk(ref, k)
            same = (torch.equal(model.to_target_ids(ref_i), ids[row])
                    and torch.allclose(ref_p, probs[row], atol=1e-5))
            bad += not same
    assert recorder.calls
    return bad


@pytest.mark.parametrize("params", [SpecParams(5, 1, 6), SpecParams(3, 3, 8)], ids=str)
def test_engine_drafts_equal_reference_drafting(params, target, drafter, prompts):
    assert mismatches(target, drafter, Eagle3Proposer, prompts[:4], params) == 0


@pytest.mark.parametrize("broken, params", [
    (OffByOnePosition, SpecParams(5, 1, 6)),
    (MisalignedExtend, SpecParams(5, 1, 6)),
    (NoTreeMask, SpecParams(3, 3, 8)),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_broken_drafting_is_caught(broken, params, target, drafter, prompts):
    assert mismatches(target, drafter, broken, prompts[:4], params) > 0
