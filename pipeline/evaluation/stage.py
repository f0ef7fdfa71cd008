"""The ``acceptance_eval`` stage: candidate vs champion vs no drafter on held-out prompts.

``run(storage, step, candidate, champion, config)`` loads the policy of RL step
``step`` (the target whose rollouts the drafters will serve), picks the held-out prompts of
the candidate's training window (:func:`pipeline.capture.heldout.heldout_prompts`: prompts no
drafter trained on), runs speculative decoding with each drafter on the same prompts,
settings and sampler, and publishes an :class:`AcceptanceReport` at ``evals/step=NNNNNN/``
(JSON, manifest last).

The sampler is the regime the rollouts were generated in: the settings the newest rollout
snapshot up to ``step`` records (:mod:`.regime`), with the run config's
overrides; greedy when no snapshot records any. Under sampling each prompt draws from a
generator seeded by ``config.seed`` and the prompt's index, the same for every contestant,
and every τ comes with a bootstrap interval over prompts (:mod:`.confidence`).

Invariants:

- Same prompts, same settings, same sampler, same target for every contestant; the
  report's ``heldout_key``, ``settings_key`` and ``sampler_key`` say so, and the promotion
  gate compares only reports whose keys agree.
- Lossless, checked twice, token for token, with greedy decoding (sampled tokens are
  checked in distribution by the tests, not per run): every contestant's greedy outputs must
  equal the no-drafter greedy outputs (on every prompt when the regime is greedy, on the
  reference sample when it is sampled: ``lossless_prompts``), and on the reference sample
  (``reference_prompts``, the longest) every contestant, the baseline included, must equal an
  independent reference, the target's plain cache-free greedy loop (:mod:`.reference`),
  which catches a bug the engine shares with itself. Mismatches are counted (fp32 ties can
  flip an argmax; more than that is a bug) and :func:`pipeline.checks.evaluation_sound`
  blocks promotion on any.
- Idempotent: a committed report with the same input fingerprint (policy, drafters,
  prompts, settings, sampler) is returned as is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from pipeline.capture.heldout import heldout_prompts
from pipeline.contracts import Manifest
from pipeline.eagle3.export import load_drafter
from pipeline.eagle3.model import Eagle3Drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.confidence import tau_interval
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.engine import EvalRun, evaluate
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.reference import (
    TIE_TOLERANCE,
    greedy_reference,
    is_near_tie,
    reference_sample,
)
from pipeline.evaluation.regime import resolve_sampler, sampler_key
from pipeline.evaluation.target import TargetRunner
from pipeline.formats import REPORT_SCHEMA_VERSION
from pipeline.layout import EVALS, eval_prefix, policy_prefix, steps_of
from pipeline.manifest import entry_for, read_manifest, withdraw_manifest, write_manifest
from pipeline.records import from_dict, from_json, to_dict, to_json
from pipeline.sampling import GREEDY, SamplingParams
from pipeline.snapshot.policy import POLICY_KIND, load_policy_ref
from pipeline.storage import Storage
from pipeline.training.stage import DRAFTER_KIND
from pipeline.verified import committed, fetch, read_verified

log = logging.getLogger(__name__)

EVAL_KIND = "acceptance_eval"
REPORT_FILE = "report.json"
NO_DRAFTER = "no_drafter"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

@dataclass(frozen=True)
class Contestant:
    """One drafter's result: where it came from and its summed acceptance counts."""

    name: str  # "candidate" | "champion" | "no_drafter"
    uri: str | None  # storage key of the drafter (None: no drafter)
    fingerprint: str | None  # the drafter manifest's fingerprint (None: no drafter)
    stats: dict[str, Any]  # AcceptanceStats.to_dict()
    outputs_match_baseline: int  # lossless_prompts whose greedy tokens equal no drafter's
    outputs_match_reference: int = 0  # reference prompts whose tokens equal the reference's
    per_prompt: list[list[int]] = field(default_factory=list)  # (emitted, cycles) per prompt
    tau_interval: list[float] = field(default_factory=list)  # [lo, hi] at report.confidence
    ties: int = 0  # mismatches (either check) that diverged at a near-tie (bf16 only)

    @property
    def acceptance(self) -> AcceptanceStats:
        return from_dict(AcceptanceStats, self.stats)

    @property
    def tau(self) -> float:
        return self.acceptance.tau


@dataclass(frozen=True)
class AcceptanceReport:
    """The stage's output record (JSON; no tensors)."""

    step: int
    policy_uri: str  # storage key of the policy checkpoint
    policy_sha256: str
    heldout: dict[str, Any]  # split, window steps, prompt count, prompt keys digest
    settings: dict[str, Any]  # SpecParams fields + max_new_tokens
    heldout_key: str
    settings_key: str
    contestants: dict[str, Contestant]
    fingerprint: str
    seconds: float
    schema_version: int = REPORT_SCHEMA_VERSION
    prompt_keys: list[str] = field(default_factory=list)
    reference: dict[str, Any] = field(default_factory=dict)  # prompts, indices (sample)
    sampler: dict[str, Any] = field(default_factory=GREEDY.to_dict)
    sampler_source: str = "greedy (a report from before schema 3)"
    sampler_key: str = ""  # derived from ``sampler`` when empty (reports before schema 3)
    seed: int = 0
    lossless_prompts: int | None = None  # None: every held-out prompt (before schema 3)
    confidence: float = 0.95
    device: str = "cpu"
    dtype: str = "float32"

    # older reports read with the defaults above: greedy, every prompt checked, fp32 on CPU
    READABLE_SCHEMA_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, REPORT_SCHEMA_VERSION)

    def __post_init__(self) -> None:
        if not self.sampler_key:
            object.__setattr__(self, "sampler_key", sampler_key(self.sampling))

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams.from_mapping(self.sampler)

    @property
    def regime(self) -> str:
        """``greedy`` or the sampler's label, e.g. ``T=1 top_p=0.9``."""
        return self.sampling.label

    @property
    def checked_prompts(self) -> int:
        """Prompts each drafter's greedy tokens were compared with no drafter's on."""
        return self.heldout["prompts"] if self.lossless_prompts is None \
            else self.lossless_prompts

    def summary(self) -> dict[str, Any]:
        """Flat numbers for metadata and logs: the regime, then τ (and its interval), α and
        lossless matches per contestant."""
        out: dict[str, Any] = {"prompts": self.heldout["prompts"], "regime": self.regime}
        for name, c in self.contestants.items():
            s = c.acceptance
            out[f"{name}_tau"] = s.tau
            if c.tau_interval:
                out[f"{name}_tau_interval"] = [round(x, 4) for x in c.tau_interval]
            out[f"{name}_match"] = f"{c.outputs_match_baseline}/{self.checked_prompts}"
            out[f"{name}_reference_match"] = (f"{c.outputs_match_reference}/"
                                              f"{self.reference.get('prompts', 0)}")
            if name != NO_DRAFTER:
                out[f"{name}_alpha"] = [round(a, 4) for a in s.alpha]
        return out


def run(storage: Storage, step: int, candidate: str,
        champion: str | None = None, config: EvalConfig = EvalConfig()
        ) -> AcceptanceReport:
    """Measure ``candidate`` (and ``champion``) drafters, storage prefixes of published
    drafters, on the held-out prompts of the candidate's window with the policy of ``step``.
    """
    started = time.perf_counter()
    drafters = {"candidate": _drafter_manifest(storage, candidate)}
    if champion is not None:
        drafters["champion"] = _drafter_manifest(storage, champion)
    window = drafters["candidate"].meta["window_steps"]
    split, prompts = heldout_prompts(storage, window, config.max_prompts)
    policy = load_policy_ref(storage, step)
    sampler, source = resolve_sampler(storage, step, config)
    heldout = {**to_dict(split), "window_steps": window, "prompts": len(prompts),
               "keys_sha256": _sha256([p.key for p in prompts])}
    fingerprint = _sha256({"step": step, "policy": policy.sha256, "heldout": heldout,
                           "config": asdict(config), "sampler": sampler.to_dict(),
                           "drafters": {k: [m.meta.get("fingerprint"), _files_digest(m)]
                                        for k, m in drafters.items()}})
    existing = _committed(storage, step, fingerprint)
    if existing is not None:
        log.info("step %d: acceptance report already committed", step)
        return existing

    local = {name: (fetch(storage, prefix, kind=DRAFTER_KIND, label="drafter"), prefix,
                    drafters[name].meta.get("fingerprint"))  # verified
             for name, prefix in (("candidate", candidate), ("champion", champion))
             if prefix is not None}
    m = measure(storage, step, [list(p.prompt_ids) for p in prompts], config, sampler, source,
                local)
    report = AcceptanceReport(
        step=step, policy_uri=policy.key, policy_sha256=policy.sha256, heldout=heldout,
        settings=m.settings, heldout_key=heldout["keys_sha256"],
        settings_key=_sha256(m.settings), contestants=m.contestants, fingerprint=fingerprint,
        seconds=time.perf_counter() - started, prompt_keys=[p.key for p in prompts],
        reference={"prompts": len(m.contest.sample), "indices": m.contest.sample},
        sampler=sampler.canonical().to_dict(), sampler_source=source,
        seed=config.seed, lossless_prompts=len(m.contest.checked),
        confidence=config.confidence, device=str(m.device), dtype=config.dtype)
    _publish(storage, report)
    return report


@dataclass(frozen=True)
class Measurement:
    """What :func:`measure` found: every contestant, and how it was measured."""

    contestants: dict[str, Contestant]
    contest: _Contest
    settings: dict[str, Any]  # SpecParams fields + max_new_tokens
    device: torch.device


def measure(storage: Storage, step: int, ids: list[list[int]], config: EvalConfig,
            sampler: SamplingParams, source: str,
            drafters: Mapping[str, tuple[Path, str | None, str | None]]) -> Measurement:
    """No drafter and each of ``drafters`` (name -> local directory, its uri and its
    fingerprint for the report) decoded on the prompts ``ids`` with the policy of ``step``,
    the same way (see the module docstring); nothing is published."""
    device, dtype = resolve_device(config.device), DTYPES[config.dtype]
    target = _load_target(storage, step, device, dtype)
    params = config.spec_params(target.config.architectures)
    settings = {**asdict(params), "max_new_tokens": config.max_new_tokens}
    TargetRunner(target).check_length(max(map(len, ids)) + config.max_new_tokens
                                      + params.num_steps)  # refuse before any work
    log.info("step %d: measuring at %s (%s) on %d prompts, %s %s", step, sampler.label,
             source, len(ids), device, config.dtype)
    contest = _Contest(target, ids, params, config, sampler)
    base = contest.measure(None)
    results = {NO_DRAFTER: contest.contestant(NO_DRAFTER, None, None, base, base)}
    embed = target.get_input_embeddings().weight.detach()
    for name, (directory, uri, fingerprint) in drafters.items():
        drafter = load_drafter(directory, embed, dtype=dtype, device=device)
        results[name] = contest.contestant(name, uri, fingerprint, contest.measure(drafter),
                                           base)
    return Measurement(results, contest, settings, device)


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

    def measure(self, drafter: Eagle3Drafter | None) -> _Measured:
        run = self._decode(drafter, self.ids, self.sampler)
        if self.sampler.greedy:
            return _Measured(run, dict(enumerate(run.outputs)))
        greedy = self._decode(drafter, [self.ids[i] for i in self.checked], GREEDY)
        return _Measured(run, dict(zip(self.checked, greedy.outputs, strict=True)))

    def _decode(self, drafter: Eagle3Drafter | None, ids: list[list[int]],
                sampler: SamplingParams) -> EvalRun:
        return evaluate(self.target, drafter, ids, self.params if drafter is not None else None,
                        max_new_tokens=self.config.max_new_tokens, eos_token_id=self.eos,
                        sampler=sampler, seed=self.config.seed)

    def contestant(self, name: str, prefix: str | None, fingerprint: str | None,
                   measured: _Measured, base: _Measured) -> Contestant:
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
                          ties + ref_ties)

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


def read_report(storage: Storage, step: int) -> AcceptanceReport | None:
    """The committed report of ``step``, or None."""
    prefix = eval_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None or manifest.kind != EVAL_KIND:
        return None
    return from_json(AcceptanceReport, read_verified(storage, prefix, manifest, REPORT_FILE))


def tau_history(storage: Storage, regime: str | None = None
                ) -> dict[str, dict[int, float]]:
    """τ per contestant per evaluated refresh step, from every committed report (of the
    sampler key ``regime`` only, when given: greedy and sampled τ are not one curve)."""
    out: dict[str, dict[int, float]] = {}
    for step in steps_of(storage.list_dirs(EVALS)):
        report = read_report(storage, step)
        if report is None or regime not in (None, report.sampler_key):
            continue
        for name, c in report.contestants.items():
            out.setdefault(name, {})[report.step] = c.tau
    return out


def _committed(storage: Storage, step: int, fingerprint: str) -> AcceptanceReport | None:
    manifest = read_manifest(storage, eval_prefix(step))
    if manifest is None or manifest.meta.get("fingerprint") != fingerprint:
        return None
    return read_report(storage, step)


def _publish(storage: Storage, report: AcceptanceReport) -> None:
    prefix = eval_prefix(report.step)
    withdraw_manifest(storage, prefix)
    written = storage.write_bytes(f"{prefix}/{REPORT_FILE}", to_json(report).encode())
    write_manifest(storage, prefix, Manifest(
        kind=EVAL_KIND, kind_version=REPORT_SCHEMA_VERSION,
        files=(entry_for(prefix, written),),
        meta={"step": report.step, "fingerprint": report.fingerprint, **report.summary()}))


def _drafter_manifest(storage: Storage, prefix: str) -> Manifest:
    manifest = committed(storage, prefix, DRAFTER_KIND)
    if "window_steps" not in manifest.meta:
        raise ValueError(f"{storage.url(prefix)}: drafter manifest has no window_steps")
    return manifest


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


def _files_digest(manifest: Manifest) -> str:
    return _sha256(sorted([f.path, f.sha256] for f in manifest.files))


def _sha256(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
