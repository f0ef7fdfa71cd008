"""Reference drafting: the drafter run autoregressively with a KV cache, one token at a time.

This is what a serving engine does at inference, written to be obviously correct rather than
fast (Python loops, one sequence, explicit softmax). It is the reference the parallel TTT
forward (:mod:`pipeline.eagle3.ttt`) is proven against.

For one sequence x_0..x_{T-1} with aux features f_0..f_{T-1}:

1. Prefill: for s = 0..T-1, decode (hidden fc(f_s), token x_{s+1}) — every decode appends its
   key/value to the cache and attends to everything in the cache, so query s sees the step-0
   keys 0..s. Its output is step 0 at position s.
2. Chain from position t: copy the first t + 1 cache entries (the step-0 keys 0..t), then for
   i = 1..K-1 decode (hidden = the previous output, token x_{t+1+i}).

The RoPE position of a decode is the number of entries already in its cache (0..s in the
prefill, t + i in a chain); nothing is masked, since a cache holds only what its query may
see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.eagle3.model import Eagle3Drafter


@dataclass
class KVCache:
    """Keys/values of one sequence, one ``(nkv, d)`` tensor per cached position."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    def prefix(self, n: int) -> KVCache:
        """A new cache with the first ``n`` entries (shared tensors, separate lists)."""
        return KVCache(list(self.keys[:n]), list(self.values[:n]))


def decode(model: Eagle3Drafter, cache: KVCache, token: int, hidden: torch.Tensor
           ) -> torch.Tensor:
    """Decode one token of one sequence; appends to ``cache``; returns h_out (H,)."""
    position = len(cache)
    cfg = model.config
    cos, sin = model.rope.cos_sin(torch.tensor([[position]]), model.dtype)  # (1, 1, d)
    embeds = model.embed(torch.tensor([[token]]))  # (1, 1, H)
    q, k, v = model.midlayer.qkv(embeds, hidden.view(1, 1, -1), cos, sin)  # (1, heads, 1, d)
    cache.keys.append(k[0, :, 0])
    cache.values.append(v[0, :, 0])
    keys = torch.stack(cache.keys)  # (n, nkv, d)
    values = torch.stack(cache.values)  # (n, nkv, d)
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    out = torch.zeros(cfg.num_attention_heads, cfg.head_dim, dtype=q.dtype)
    for head in range(cfg.num_attention_heads):
        kv_head = head // n_rep
        scores = keys[:, kv_head] @ q[0, head, 0] * model.scale  # (n,)
        probs = torch.exp(scores - scores.max())
        probs = probs / probs.sum()
        out[head] = probs @ values[:, kv_head]  # (d,)
    h_out = model.midlayer.finish(hidden.view(1, 1, -1), out.view(1, -1, 1, cfg.head_dim))
    return h_out.view(-1)


@torch.no_grad()
def draft_reference_logits(model: Eagle3Drafter, input_ids: torch.Tensor,
                           aux_hidden: torch.Tensor, depth: int, *, pad_token_id: int = 0
                           ) -> torch.Tensor:
    """(depth, T, Vd): logits of step i of the chain started at position t, autoregressively.

    ``input_ids`` (T,) the sequence, ``aux_hidden`` (T, 3·Ht) its features; a token past the
    end is ``pad_token_id``.
    """
    ids = [int(x) for x in input_ids]
    t_len = len(ids)

    def token(j: int) -> int:
        return ids[j] if j < t_len else pad_token_id

    h0 = model.project(aux_hidden.unsqueeze(0))[0]  # (T, H)
    cache = KVCache()
    step0 = []
    for s in range(t_len):  # prefill, one decode per position
        step0.append(decode(model, cache, token(s + 1), h0[s]))
    logits = torch.zeros(depth, t_len, model.config.draft_vocab_size, dtype=torch.float32)
    for t in range(t_len):
        chain = cache.prefix(t + 1)  # step-0 keys 0..t
        hidden = step0[t]
        logits[0, t] = model.compute_logits(hidden).float()
        for i in range(1, depth):
            hidden = decode(model, chain, token(t + 1 + i), model.feedback(hidden))
            logits[i, t] = model.compute_logits(hidden).float()
    return logits
