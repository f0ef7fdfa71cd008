"""The ``acceptance_eval`` stage: candidate vs champion vs no drafter on held-out prompts.

``run(storage, step, candidate, champion, config, evaluator)`` picks the held-out prompts of
the candidate's training window (:func:`pipeline.capture.heldout.heldout_prompts`: prompts no
drafter trained on), has the evaluator decode them speculatively with each drafter, and no
drafter, against the policy of RL step ``step`` (the target whose rollouts the drafters will
serve) with the same settings and sampler, and publishes an :class:`AcceptanceReport` at
``evals/step=NNNNNN/`` (JSON, manifest last). The evaluator (:mod:`.evaluators`) is
Aerie's in-process engine (:mod:`.inprocess`) by default, or a serving engine's servers
(:mod:`.on_engine`); the report records which.

The sampler is the regime the rollouts were generated in: the settings the newest rollout
snapshot up to ``step`` records (:mod:`.regime`), with the run config's
overrides; greedy when no snapshot records any. Under sampling each prompt draws from a
generator seeded by ``config.seed`` and the prompt's index, the same for every contestant,
and every τ comes with a bootstrap interval over prompts (:mod:`.confidence`).

Invariants:

- Same prompts, same settings, same sampler, same target for every contestant; the
  report's ``heldout_key``, ``settings_key`` and ``sampler_key`` say so, and the promotion
  gate compares only reports whose keys agree. τ of different evaluators are never one
  curve (:attr:`AcceptanceReport.comparable_key`).
- Lossless, token for token, with greedy decoding (sampled tokens are checked in
  distribution by the tests, not per run): every contestant's greedy outputs must equal the
  no-drafter greedy outputs (on every prompt when the regime is greedy, on the reference
  sample when it is sampled: ``lossless_prompts``). In process, every contestant, the
  baseline included, must also equal an independent reference on the reference sample
  (``reference_prompts``, the longest): the target's plain cache-free greedy loop
  (:mod:`.reference`), which catches a bug the engine shares with itself; on an engine the
  no-drafter server is the reference. Mismatches are counted (near-ties apart, each
  evaluator's own way) and :func:`pipeline.checks.evaluation_sound` blocks promotion on any.
- Idempotent: a committed report with the same input fingerprint (policy, drafters,
  prompts, settings, sampler, and for an engine the evaluator's kind, launch template
  digest and near-tie bound) is returned as is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from pipeline.capture.heldout import heldout_prompts
from pipeline.contracts import Manifest
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.contest import INPROCESS_RECORD, NO_DRAFTER, Contestant
from pipeline.evaluation.evaluators import INPROCESS, Evaluator, measure
from pipeline.evaluation.regime import resolve_sampler, sampler_key
from pipeline.formats import REPORT_SCHEMA_VERSION
from pipeline.layout import EVALS, eval_prefix, steps_of
from pipeline.manifest import entry_for, read_manifest, withdraw_manifest, write_manifest
from pipeline.records import from_json, to_dict, to_json
from pipeline.sampling import GREEDY, SamplingParams
from pipeline.snapshot.policy import load_policy_ref
from pipeline.storage import Storage
from pipeline.training.stage import DRAFTER_KIND
from pipeline.verified import committed, fetch, read_verified

log = logging.getLogger(__name__)

EVAL_KIND = "acceptance_eval"
REPORT_FILE = "report.json"

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
    evaluator: dict[str, Any] = field(default_factory=lambda: dict(INPROCESS_RECORD))

    # older reports read with the defaults above: greedy, every prompt checked, fp32 on CPU,
    # Aerie's in-process engine
    READABLE_SCHEMA_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3, REPORT_SCHEMA_VERSION)

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
    def evaluator_kind(self) -> str:
        """Who measured: ``inprocess`` or the engine's evaluator (``sglang``); the gate and
        the τ curves compare only reports of one kind."""
        return self.evaluator.get("kind", "inprocess")

    @property
    def comparable_key(self) -> str:
        """Two τ are one curve only when this agrees: the sampler's key, and the evaluator
        and its version when it is an engine (the in-process key is the sampler's alone, as
        before evaluators)."""
        kind = self.evaluator_kind
        return self.sampler_key if kind == "inprocess" else \
            f"{kind} {self.evaluator.get('version')}:{self.sampler_key}"

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
        champion: str | None = None, config: EvalConfig = EvalConfig(),
        evaluator: Evaluator = INPROCESS) -> AcceptanceReport:
    """Measure ``candidate`` (and ``champion``) drafters, storage prefixes of published
    drafters, on the held-out prompts of the candidate's window with the policy of ``step``,
    by ``evaluator`` (default: Aerie's in-process engine).
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
                                        for k, m in drafters.items()},
                           **({"evaluator": evaluator.identity()} if evaluator.identity()
                              else {})})
    existing = _committed(storage, step, fingerprint)
    if existing is not None:
        log.info("step %d: acceptance report already committed", step)
        return existing

    local = {name: (fetch(storage, prefix, kind=DRAFTER_KIND, label="drafter"), prefix,
                    drafters[name].meta.get("fingerprint"))  # verified
             for name, prefix in (("candidate", candidate), ("champion", champion))
             if prefix is not None}
    m = measure(evaluator, storage, step, [list(p.prompt_ids) for p in prompts], config,
                sampler, source, local)
    report = AcceptanceReport(
        step=step, policy_uri=policy.key, policy_sha256=policy.sha256, heldout=heldout,
        settings=m.settings, heldout_key=heldout["keys_sha256"],
        settings_key=_sha256(m.settings), contestants=m.contestants, fingerprint=fingerprint,
        seconds=time.perf_counter() - started, prompt_keys=[p.key for p in prompts],
        reference={"prompts": m.reference_prompts, "indices": m.sample},
        sampler=sampler.canonical().to_dict(), sampler_source=source,
        seed=config.seed, lossless_prompts=len(m.checked),
        confidence=config.confidence, device=m.device, dtype=m.dtype,
        evaluator=m.evaluator)
    _publish(storage, report)
    return report


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
    :attr:`AcceptanceReport.comparable_key` ``regime`` only, when given: greedy and sampled
    τ, or τ from Aerie's engine and from SGLang's, are not one curve)."""
    out: dict[str, dict[int, float]] = {}
    for step in steps_of(storage.list_dirs(EVALS)):
        report = read_report(storage, step)
        if report is None or regime not in (None, report.comparable_key):
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


def _files_digest(manifest: Manifest) -> str:
    return _sha256(sorted([f.path, f.sha256] for f in manifest.files))


def _sha256(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
