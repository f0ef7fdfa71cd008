"""The ``inprocess`` evaluator: Aerie's own engine (:mod:`.engine`) decodes every contestant
in this process, on one device, one prompt at a time.

No drafter and each drafter decode the same prompts at the same sampler (the same
per-prompt seeds); the prompts of the lossless check are decoded greedily as well, and the
reference sample (the longest prompts) also by the target's plain cache-free greedy loop
(:mod:`.reference`), which catches a bug the engine shares with itself. In bf16 a
divergence at a near-tie (:data:`.reference.TIE_TOLERANCE`) is counted, not failed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.algorithms import algorithm_of_directory, read_config, serving_of
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.confidence import tau_interval
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.contest import (
    INPROCESS_RECORD,
    NO_DRAFTER,
    Contestant,
    Measurement,
    reference_sample,
)
from pipeline.evaluation.engine import EvalRun, evaluate
from pipeline.evaluation.reference import (
    TIE_TOLERANCE,
    greedy_reference,
    is_near_tie,
)
from pipeline.evaluation.target import TargetRunner
from pipeline.layout import policy_prefix
from pipeline.records import to_dict
from pipeline.sampling import GREEDY, SamplingParams
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import fetch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure(storage: Storage, step: int, ids: list[list[int]], config: EvalConfig,
            sampler: SamplingParams, source: str,
            drafters: Mapping[str, tuple[Path, str | None, str | None]]) -> Measurement:
    """No drafter and each of ``drafters`` (name -> local directory, its uri and its
    fingerprint for the report) decoded on the prompts ``ids`` with the policy of ``step``,
    the same way (module docstring); nothing is published."""
    device, dtype = resolve_device(config.device), DTYPES[config.dtype]
    target = _load_target(storage, step, device, dtype)
    params = config.spec_params(target.config.architectures)
    settings = {**asdict(params), "max_new_tokens": config.max_new_tokens}
    served = {name: serving_of(read_config(directory), params, str(directory))[1]
              for name, (directory, _, _) in drafters.items()}  # each as its algorithm serves
    TargetRunner(target).check_length(max(map(len, ids)) + config.max_new_tokens + max(
        [params.num_steps, *(s.num_steps for s in served.values())]))  # refuse before work
    log.info("step %d: measuring at %s (%s) on %d prompts, %s %s", step, sampler.label,
             source, len(ids), device, config.dtype)
    contest = _Contest(target, ids, params, config, sampler)
    base = contest.measure(None)
    results = {NO_DRAFTER: contest.contestant(NO_DRAFTER, None, None, base, base)}
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()  # DFlash drafts with it
    for name, (directory, uri, fingerprint) in drafters.items():
        drafter = algorithm_of_directory(directory).load(directory, embed, head=head,
                                                         dtype=dtype, device=device)
        own = served[name]
        results[name] = contest.contestant(name, uri, fingerprint,
                                           contest.measure(drafter, own), base,
                                           None if own == params else asdict(own))
    return Measurement(results, settings, checked=contest.checked, sample=contest.sample,
                       reference_prompts=len(contest.sample), device=str(device),
                       dtype=config.dtype, evaluator=dict(INPROCESS_RECORD))


@dataclass(frozen=True)
class _Measured:
    run: EvalRun  # at the report's sampler
    greedy: dict[int, list[int]]  # greedy outputs of the checked prompts, by prompt index


class _Contest:
    """Decodes every contestant the same way: the prompts at the sampler (same seeds), and
    greedily the prompts of the token-for-token lossless check."""

    def __init__(self, target: torch.nn.Module, ids: list[list[int]], params: SpecParams,
                 config: EvalConfig, sampler: SamplingParams):
        self.target, self.ids, self.params, self.config = target, ids, params, config
        self.sampler, self.eos = sampler, stop_token_ids(target)
        self.sample = reference_sample([len(p) for p in ids], config.reference_prompts)
        self.reference = {i: greedy_reference(target, ids[i], config.max_new_tokens, self.eos)
                          for i in self.sample}
        self.checked = list(range(len(ids))) if sampler.greedy else self.sample

    def measure(self, drafter: nn.Module | None, params: SpecParams | None = None
                ) -> _Measured:
        """``drafter`` decoded with ``params`` (default: the contest's)."""
        params = params or self.params
        run = self._decode(drafter, self.ids, self.sampler, params)
        if self.sampler.greedy:
            return _Measured(run, dict(enumerate(run.outputs)))
        greedy = self._decode(drafter, [self.ids[i] for i in self.checked], GREEDY, params)
        return _Measured(run, dict(zip(self.checked, greedy.outputs, strict=True)))

    def _decode(self, drafter: nn.Module | None, ids: list[list[int]],
                sampler: SamplingParams, params: SpecParams) -> EvalRun:
        return evaluate(self.target, drafter, ids, params if drafter is not None else None,
                        max_new_tokens=self.config.max_new_tokens, eos_token_id=self.eos,
                        sampler=sampler, seed=self.config.seed)

    def contestant(self, name: str, prefix: str | None, fingerprint: str | None,
                   measured: _Measured, base: _Measured,
                   settings: dict[str, Any] | None = None) -> Contestant:
        expected = {i: base.greedy[i] for i in self.checked}
        match, ties = self._compare(measured.greedy, expected)
        if match + ties < len(self.checked):
            log.warning("%s emitted other tokens than greedy decoding on %d of %d prompts",
                        name, len(self.checked) - match - ties, len(self.checked))
        ref_match, ref_ties = self._compare(measured.greedy, self.reference)
        if ref_match + ref_ties < len(self.reference):
            _log_reference_mismatch(measured.greedy, self.reference)
        per_prompt = [list(c) for c in measured.run.per_prompt]
        return Contestant(name, prefix, fingerprint, to_dict(measured.run.stats), match,
                          ref_match, per_prompt,
                          list(tau_interval(per_prompt, self.config.confidence)),
                          ties + ref_ties, settings)

    def _compare(self, outputs: dict[int, list[int]], expected: dict[int, list[int]]
                 ) -> tuple[int, int]:
        """(prompts equal to ``expected``, prompts that diverge at a near-tie)."""
        tolerance = TIE_TOLERANCE[self.config.dtype]
        differ = [i for i, tokens in expected.items() if outputs[i] != tokens]
        ties = sum(is_near_tie(self.target, self.ids[i], expected[i], outputs[i], tolerance)
                   for i in differ)
        return len(expected) - len(differ), ties


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("evaluation device 'cuda' was asked for, but torch sees no CUDA "
                           "device; use device 'cpu' or 'auto'")
    return torch.device(name)


def _log_reference_mismatch(outputs: dict[int, list[int]], reference: dict[int, list[int]]
                            ) -> None:
    differ = [i for i, tokens in reference.items() if outputs[i] != tokens]
    i = differ[0]
    pairs = zip(outputs[i], reference[i], strict=False)  # one may stop earlier
    at = next((t for t, (a, b) in enumerate(pairs) if a != b),
              min(len(outputs[i]), len(reference[i])))
    log.warning("%d of %d sampled prompts differ from the cache-free greedy reference "
                "(first: prompt %d at generated token %d)", len(differ), len(reference), i, at)


def stop_token_ids(model: torch.nn.Module) -> frozenset[int]:
    """Every token that ends the target's turn: ``eos_token_id`` of its ``config.json`` and
    of its ``generation_config.json`` (an int or a list in either; chat models often list
    their turn closer, e.g. ``<|eot_id|>`` or ``<|im_end|>``, only in the latter), as the
    serving engines and ``generate`` stop."""
    found: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        for token in [value] if isinstance(value, int) else value:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"eos_token_id {value!r} of the target is not a token id")
            found.add(token)
    return frozenset(found)


def _load_target(storage: Storage, step: int, device: torch.device, dtype: torch.dtype
                 ) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    local = fetch(storage, policy_prefix(step), kind=POLICY_KIND, label="policy")  # verified
    model = AutoModelForCausalLM.from_pretrained(str(local), dtype=dtype)
    return model.to(device).eval()


