"""How far the policy has drifted from the step-0 policy.

Responsible for two numbers per RL step, measured on a fixed set of held-out prompts:

- ``kl_to_step0``: mean over response positions of KL(p_s || p_0), the divergence of the
  step-s next-token distribution from the step-0 one;
- ``top1_agreement_with_step0``: fraction of those positions where both argmaxes agree.

Definition: the step-s policy answers every held-out prompt greedily; the resulting
sequences (prompt + response, EOS included) are teacher-forced through both policies, and
the positions that predict the response tokens are compared. Measuring on the *current*
policy's own outputs is what a drafter trained at step 0 faces when serving step s, so
this is the drift that costs speculative-decoding acceptance. At step 0 the KL is 0 and
the agreement 1 by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pipeline.demo import corpus


@dataclass(frozen=True)
class Drift:
    """Drift of one policy against the reference, over ``positions`` response positions."""

    kl: float
    top1_agreement: float
    positions: int


@torch.no_grad()
def response_logprobs(model: PreTrainedModel, prompts: list[list[int]],
                      responses: list[list[int]], pad_id: int) -> torch.Tensor:
    """Log-probs ``(N, V)`` of the next token at every position that predicts a response token.

    Rows are in order: prompt by prompt, response position by position.
    """
    was_training = model.training
    model.eval()
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    ids, mask = corpus.right_pad(seqs, pad_id)  # (B, T)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()  # (B, T, V)
    model.train(was_training)
    rows = []
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        # position t predicts token t + 1: the response tokens are predicted by
        # positions len(p) - 1 .. len(p) + len(r) - 2.
        rows.append(logits[b, len(p) - 1: len(p) + len(r) - 1])
    return torch.log_softmax(torch.cat(rows, dim=0), dim=-1)


def measure_drift(policy: PreTrainedModel, reference: PreTrainedModel, prompts: list[list[int]],
                  responses: list[list[int]], pad_id: int) -> Drift:
    """KL(policy || reference) and top-1 agreement on ``responses`` (policy's own outputs)."""
    logp_s = response_logprobs(policy, prompts, responses, pad_id)  # (N, V)
    logp_0 = response_logprobs(reference, prompts, responses, pad_id)  # (N, V)
    kl = (logp_s.exp() * (logp_s - logp_0)).sum(-1)  # (N,)
    agree = logp_s.argmax(-1) == logp_0.argmax(-1)  # (N,)
    return Drift(kl=kl.mean().item(), top1_agreement=agree.float().mean().item(),
                 positions=int(kl.numel()))
