"""What the demo trainer's rollout engine reports about its speculative decoding.

A real RL engine generating with an EAGLE-3 drafter reports per request how many verify
passes it ran and how many tokens came out (SGLang's ``meta_info``). The demo world samples
its rollouts without a drafter, so its trainer computes what its engine would have reported:
for the first rollout of each of the first ``prompts`` prompts, Aerie's own lossless EAGLE-3
engine (:func:`pipeline.evaluation.engine.evaluate`, the one the offline evaluation and the
SGLang contract server use) decodes the rollout's prompt with the step's policy and the
drafter serving now (the serving record), at the rollouts' sampler, and the counts become the
record's ``speculative`` field. Speculative sampling is lossless in distribution, so those
counts are those of a sample of the same distribution the rollout was drawn from. As an
engine's counters describe the response they came with, the sample is cut at the rollout's
own length, as a ``max_new_tokens`` of that length would stop it: the passes that emitted
its first tokens, the last one cut short (:func:`capped_counts`).

The trainer generates on :data:`SERVERS` simulated rollout servers, prompt ``n`` of those
with counters on server ``n mod len(SERVERS)``; each server drafts with what the serving
record says it serves (:meth:`~pipeline.serving_now.ServingManifest.on`), so while a canary
serves part of them, the step's counters carry both drafters' versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.sampling import SamplingParams
from pipeline.serving_now import materialize_drafter, read_serving
from pipeline.storage import Storage

SERVERS = ("rollout-0", "rollout-1", "rollout-2", "rollout-3")


def with_counters(records: Sequence[Mapping[str, Any]], policy_dir: Path, storage: Storage,
                  name: str, cache_dir: Path, *, sampling: Mapping[str, Any],
                  max_new_tokens: int, prompts: int = 4, seed: int = 0
                  ) -> list[dict[str, Any]]:
    """``records`` with ``speculative`` counters on the first rollout of each of the first
    ``prompts`` distinct prompts where its server drafts; unchanged while no drafter serves
    ``name``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pipeline.algorithms import algorithm_of_directory
    from pipeline.evaluation.engine import CycleTrace, evaluate
    from pipeline.evaluation.inprocess import stop_token_ids

    out = [dict(r) for r in records]
    serving = read_serving(storage, name)
    if serving is None or (serving.target is None and serving.canary is None):
        return out
    chosen, seen = [], set()
    for i, r in enumerate(out):
        key = tuple(r["prompt_token_ids"])
        if key not in seen and len(chosen) < prompts:
            seen.add(key)
            chosen.append(i)
    by_drafter: dict[str, tuple[Any, list[int]]] = {}  # fingerprint -> (manifest, rows)
    for n, i in enumerate(chosen):
        served = serving.on(SERVERS[n % len(SERVERS)], SERVERS)
        if served.target is not None:
            by_drafter.setdefault(served.target.fingerprint, (served, []))[1].append(i)
    if not by_drafter:
        return out
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per step would break the demo's step lines
    try:
        target = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for served, rows in by_drafter.values():
        local = materialize_drafter(storage, served.target.drafter_uri, cache_dir,
                                    fingerprint=served.target.fingerprint)
        drafter = algorithm_of_directory(local).load(
            local, target.get_input_embeddings().weight.detach(),
            head=target.get_output_embeddings().weight.detach())
        trace: list[CycleTrace] = []
        run = evaluate(target, drafter, [out[i]["prompt_token_ids"] for i in rows],
                       served.settings, max_new_tokens=max_new_tokens,
                       eos_token_id=stop_token_ids(target),
                       sampler=SamplingParams.from_mapping(sampling), seed=seed, trace=trace)
        for n, (i, tokens) in enumerate(zip(rows, run.outputs, strict=True)):
            passes = [len(c.emitted) for c in trace if c.prompt_index == n]
            verify, completion = capped_counts(passes, len(tokens),
                                               len(out[i]["response_token_ids"]))
            out[i]["speculative"] = {"drafter_version": served.target.registry_version,
                                     "verify_ct": verify, "completion_tokens": completion}
    return out


def capped_counts(passes: Sequence[int], generated: int, limit: int) -> tuple[int, int]:
    """``(verify passes, completion tokens)`` of a decode whose passes emitted ``passes``
    tokens each (after the prefill token; ``generated`` tokens in all, the prefill one
    first, an end token possibly cutting the last pass), stopped at ``limit`` tokens."""
    completion = min(generated, limit)
    verify, emitted = 0, 0
    for count in passes:
        if emitted >= completion - 1:
            break
        verify, emitted = verify + 1, emitted + count
    return verify, completion
