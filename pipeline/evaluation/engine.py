"""EAGLE-3 speculative decoding, SGLang-style, one sequence at a time, greedy or sampled.

Per prompt:

1. *Prefill*: the target runs the prompt into its KV cache; its next token (the argmax, or
   a draw from its sampling distribution) is the first generated token (the ROOT of the
   first cycle) and the drafter is *extended* with the prompt's aux features paired with
   the next tokens (x_1..x_P, the last being the root).
2. *Cycles* until EOS or ``max_new_tokens``: draft a tree ``num_steps`` deep
   (:func:`~pipeline.evaluation.tree.draft_tree`); verify all its nodes in ONE target
   forward pass with tree attention; accept (:func:`~pipeline.evaluation.sampling.judge`:
   the greedy walk at temperature 0, speculative sampling above); emit the accepted tokens
   plus the bonus token; prune the target cache to the accepted path; extend the drafter
   with the real target features of the root and the accepted nodes (draft extend).

Without a drafter every cycle verifies only the root: plain decoding with a KV cache
(greedy, or one draw per token), τ = 1 by definition.

Invariants:

- Lossless: at temperature 0 the emitted tokens are the target's greedy decoding, token for
  token, whatever the drafter proposes (tests compare against a cache-free greedy loop); at
  temperature > 0 every emitted token is a sample of the target's own distribution given
  the tokens before it (tests compare the distributions).
- Never more than ``max_new_tokens`` tokens; EOS (any of ``eos_token_id``) is emitted, then
  the prompt stops. A truncated cycle counts only what it emitted (see :mod:`.metrics`).
- Reproducible: greedy decoding draws nothing; sampling draws every uniform from one
  generator per prompt, seeded from ``seed`` and the prompt's index, so a fixed seed gives
  identical tokens and counts, and every contestant sees the same seeds.
  Everything runs under ``torch.inference_mode()``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.algorithms import algorithm_of_model, as_drafter
from pipeline.attention_kernels import shape_stable
from pipeline.drafters.protocol import Drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.sampling import first_token, judge
from pipeline.evaluation.target import TargetRunner
from pipeline.evaluation.tree import VerifyTree, draft_tree
from pipeline.sampling import GREEDY, SamplingParams, prompt_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalRun:
    """What :func:`evaluate` returns; unpacks as ``stats, outputs = evaluate(...)``."""

    stats: AcceptanceStats
    outputs: list[list[int]]  # generated token ids per prompt (prefill token first)
    per_prompt: list[tuple[int, int]]  # (emitted_tokens, cycles) per prompt, for intervals

    def __iter__(self) -> Iterator[Any]:
        return iter((self.stats, self.outputs))


@dataclass(frozen=True)
class CycleTrace:
    """One cycle, for tests and debugging: the verified tree and what came of it."""

    prompt_index: int
    root_position: int
    tree: VerifyTree
    path: list[int]  # accepted tree nodes, root (0) first
    emitted: list[int]


def evaluate(target: nn.Module, drafter: nn.Module | Drafter | None,
             prompts: Sequence[Sequence[int]], params: SpecParams | None = None, *,
             max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
             sampler: SamplingParams = GREEDY, seed: int = 0,
             trace: list[CycleTrace] | None = None) -> EvalRun:
    """Speculative decoding of every prompt; summed stats and the outputs.

    ``target``: a transformers Llama-style causal LM. ``drafter``: a
    drafter family's model (e.g. from its ``load``), any :class:`Drafter`, or None for
    the no-drafter baseline. ``params`` default to SGLang's auto choice for the target's
    architecture, as the drafter's algorithm serves with them (DFlash: its block's chain;
    ignored without a drafter). ``eos_token_id``: None never stops early.
    ``sampler``: how the target samples (greedy by default); ``seed`` seeds prompt i's
    generator with ``prompt_seed(seed, i)``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    proposer = as_drafter(drafter) if drafter is not None else None
    if proposer is not None and params is None:  # as the drafter's algorithm serves it
        params = SpecParams.auto_for(getattr(target.config, "architectures", None))
        if proposer is not drafter:  # an algorithm's model
            found = algorithm_of_model(drafter)
            params = found.settings_for(found.config_json(drafter.config), params)
    eos = _eos_set(eos_token_id)
    runner = TargetRunner(target, proposer.aux_layer_ids if proposer is not None else ())
    stats = AcceptanceStats(params.num_steps if proposer is not None and params else 0)
    outputs: list[list[int]] = []
    per_prompt: list[tuple[int, int]] = []
    modules = [m for m in (target, drafter) if isinstance(m, nn.Module)]
    with torch.inference_mode(), _eval_mode(modules), shape_stable():
        for i, prompt in enumerate(prompts):
            generator = torch.Generator().manual_seed(prompt_seed(seed, i))
            out, one = generate(runner, proposer, prompt, params, max_new_tokens, eos,
                                sampler=sampler, generator=generator, trace=trace,
                                prompt_index=i)
            stats = stats.merge(one)
            outputs.append(out)
            per_prompt.append((one.emitted_tokens, one.cycles))
    logger.info("speculative decoding (%s): %d prompts, %d cycles, tau=%.3f, alpha=%s, "
                "draft %.2fs, verify %.2fs", sampler.label, stats.prompts, stats.cycles,
                stats.tau,
                [round(a, 3) for a in stats.alpha], stats.draft_seconds, stats.verify_seconds)
    return EvalRun(stats, outputs, per_prompt)


def generate(runner: TargetRunner, drafter: Drafter | None, prompt: Sequence[int],
             params: SpecParams | None, max_new_tokens: int, eos: frozenset[int], *,
             sampler: SamplingParams = GREEDY, generator: torch.Generator | None = None,
             trace: list[CycleTrace] | None = None, prompt_index: int = 0
             ) -> tuple[list[int], AcceptanceStats]:
    """One prompt (call under ``torch.inference_mode()``): generated ids and its stats.
    ``generator`` supplies every uniform a sampled decoding draws."""
    if not len(prompt):
        raise ValueError("cannot decode an empty prompt")
    if drafter is not None and params is None:
        raise ValueError("a drafter needs SpecParams")
    lookahead = params.num_steps if drafter is not None and params is not None else 0
    runner.check_length(len(prompt) + max_new_tokens + lookahead)  # tree nodes reach past
    stats = AcceptanceStats(params.num_steps if drafter is not None and params else 0,
                            prompts=1, prefill_tokens=1)
    clock = _Clock(runner.device)
    logits, aux = runner.prefill(torch.as_tensor(list(prompt), dtype=torch.long))
    root = first_token(logits, sampler, generator)
    stats.prefill_seconds += clock.lap()
    out = [root]
    if root in eos or max_new_tokens == 1:
        return out, stats
    if drafter is not None:
        drafter.reset(list(prompt))
        drafter.extend(torch.tensor([*list(prompt)[1:], root]), aux)
        stats.draft_seconds += clock.lap()
    while True:
        prefix = runner.length  # = the root's position
        if drafter is not None and params is not None:
            _, tree = draft_tree(drafter.propose, root, params.num_steps, params.eagle_topk,
                                 params.num_draft_tokens)
        else:
            tree = VerifyTree(torch.tensor([root]), torch.tensor([-1]), torch.tensor([0]))
        if drafter is not None:
            stats.draft_seconds += clock.lap()
        logits, aux = runner.verify(tree.tokens, tree.depths, tree.ancestor_mask())
        verdict = judge(tree, logits, sampler, generator)
        path = verdict.path
        new = [*tree.tokens[path[1:]].tolist(), verdict.bonus]  # accepted + bonus
        emitted = _truncate(new, eos, max_new_tokens - len(out))
        out.extend(emitted)
        done = (len(emitted) < len(new) or emitted[-1] in eos
                or len(out) == max_new_tokens)
        if not done:
            runner.keep(prefix, path)
        stats.verify_seconds += clock.lap()
        if len(emitted) == len(new):
            stats.add_cycle(len(path) - 1, verdict.attempted, bonus=True)
        else:
            stats.add_cycle(len(emitted), len(emitted), bonus=False)
        if trace is not None:
            trace.append(CycleTrace(prompt_index, prefix, tree, path, emitted))
        if done:
            return out, stats
        if drafter is not None:
            drafter.extend(torch.tensor(new), None if aux is None else aux[path])
            stats.draft_seconds += clock.lap()
        root = new[-1]


def _truncate(tokens: list[int], eos: frozenset[int], budget: int) -> list[int]:
    """``tokens`` up to and including the first EOS, at most ``budget`` of them."""
    for i, token in enumerate(tokens):
        if token in eos:
            tokens = tokens[:i + 1]
            break
    return tokens[:budget]


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


class _Clock:
    """Lap timer; waits for the device so GPU work lands in the phase that queued it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        elapsed, self.last = now - self.last, now
        return elapsed


@contextlib.contextmanager
def _eval_mode(modules: list[nn.Module]) -> Iterator[None]:
    """``eval()`` for the run, each module's training flag restored afterwards."""
    flags = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, flag in zip(modules, flags, strict=True):
            m.train(flag)
