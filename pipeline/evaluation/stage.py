"""The ``acceptance_eval`` stage: candidate vs champion vs no drafter on held-out prompts.

``run(storage, step, candidate, champion, config)`` loads the policy of RL step
``step`` (the target whose rollouts the drafters will serve), picks the held-out prompts of
the candidate's training window (:func:`pipeline.capture.heldout.heldout_prompts`: prompts no
drafter trained on), runs greedy speculative decoding with each drafter on the same prompts
and settings, and publishes an :class:`AcceptanceReport` at ``evals/step=NNNNNN/`` (JSON,
manifest last).

Invariants:

- Same prompts, same settings, same target for every contestant; the report's
  ``heldout_key`` and ``settings_key`` say so, and the promotion gate compares only reports
  whose keys agree.
- Lossless, checked twice: greedy speculative decoding must emit the no-drafter tokens, so
  every contestant's outputs are compared with the baseline's; and on a sample of the
  prompts (``reference_prompts``, the longest) every contestant, the baseline included, is
  compared with an independent reference, the target's plain cache-free greedy loop
  (:mod:`.reference`), which catches a bug the engine shares with itself. Mismatches are
  counted (fp32 ties can flip an argmax; more than that is a bug) and
  :func:`pipeline.checks.evaluation_sound` blocks promotion on any.
- Idempotent: a committed report with the same input fingerprint (policy, drafters,
  prompts, settings) is returned as is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pipeline.capture.heldout import heldout_prompts
from pipeline.contracts import Manifest
from pipeline.eagle3.export import load_drafter
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.engine import evaluate
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.reference import greedy_reference, reference_sample
from pipeline.evaluation.target import TargetRunner
from pipeline.layout import EVALS, eval_prefix, policy_prefix, steps_of
from pipeline.manifest import entry_for, read_manifest, withdraw_manifest, write_manifest
from pipeline.records import from_dict, from_json, to_dict, to_json
from pipeline.snapshot.policy import POLICY_KIND, load_policy_ref
from pipeline.storage import Storage
from pipeline.training.stage import DRAFTER_KIND
from pipeline.verified import committed, fetch, read_verified

log = logging.getLogger(__name__)

EVAL_KIND = "acceptance_eval"
REPORT_SCHEMA_VERSION = 2  # 2: the cache-free reference sample (reference, *_reference)
REPORT_FILE = "report.json"
NO_DRAFTER = "no_drafter"

@dataclass(frozen=True)
class Contestant:
    """One drafter's result: where it came from and its summed acceptance counts."""

    name: str  # "candidate" | "champion" | "no_drafter"
    uri: str | None  # storage key of the drafter (None: no drafter)
    fingerprint: str | None  # the drafter manifest's fingerprint (None: no drafter)
    stats: dict[str, Any]  # AcceptanceStats.to_dict()
    outputs_match_baseline: int  # prompts whose tokens equal the no-drafter tokens
    outputs_match_reference: int = 0  # sampled prompts whose tokens equal the reference's

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

    def summary(self) -> dict[str, Any]:
        """Flat numbers for metadata and logs: τ, α and lossless matches per contestant."""
        out: dict[str, Any] = {"prompts": self.heldout["prompts"]}
        for name, c in self.contestants.items():
            s = c.acceptance
            out[f"{name}_tau"] = s.tau
            out[f"{name}_match"] = f"{c.outputs_match_baseline}/{self.heldout['prompts']}"
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
    heldout = {**to_dict(split), "window_steps": window, "prompts": len(prompts),
               "keys_sha256": _sha256([p.key for p in prompts])}
    fingerprint = _sha256({"step": step, "policy": policy.sha256, "heldout": heldout,
                           "config": asdict(config), "drafters": {
                               k: [m.meta.get("fingerprint"), _files_digest(m)]
                               for k, m in drafters.items()}})
    existing = _committed(storage, step, fingerprint)
    if existing is not None:
        log.info("step %d: acceptance report already committed", step)
        return existing

    target = _load_target(storage, step)
    params = config.spec_params(target.config.architectures)
    settings = {**asdict(params), "max_new_tokens": config.max_new_tokens}
    eos = stop_token_ids(target)
    ids = [list(p.prompt_ids) for p in prompts]
    TargetRunner(target).check_length(max(map(len, ids)) + config.max_new_tokens
                                      + params.num_steps)  # refuse before any work
    sample = reference_sample([len(p) for p in ids], config.reference_prompts)
    reference = {i: greedy_reference(target, ids[i], config.max_new_tokens, eos)
                 for i in sample}
    base = evaluate(target, None, ids, None, max_new_tokens=config.max_new_tokens,
                    eos_token_id=eos)
    results = {NO_DRAFTER: Contestant(NO_DRAFTER, None, None, to_dict(base.stats),
                                      len(ids), _matches(base.outputs, reference))}
    embed = target.get_input_embeddings().weight.detach()
    for name, prefix in (("candidate", candidate), ("champion", champion)):
        if prefix is None:
            continue
        local = fetch(storage, prefix, kind=DRAFTER_KIND, label="drafter")  # verified
        drafter = load_drafter(local, embed, dtype=torch.float32)
        run = evaluate(target, drafter, ids, params, max_new_tokens=config.max_new_tokens,
                       eos_token_id=eos)
        match = sum(a == b for a, b in zip(run.outputs, base.outputs, strict=True))
        if match < len(ids):
            log.warning("step %d: %s emitted other tokens than greedy decoding on %d of %d "
                        "prompts", step, name, len(ids) - match, len(ids))
        results[name] = Contestant(name, prefix,
                                   drafters[name].meta.get("fingerprint"),
                                   to_dict(run.stats), match, _matches(run.outputs, reference))
    report = AcceptanceReport(
        step=step, policy_uri=policy.key, policy_sha256=policy.sha256, heldout=heldout,
        settings=settings, heldout_key=heldout["keys_sha256"], settings_key=_sha256(settings),
        contestants=results, fingerprint=fingerprint, seconds=time.perf_counter() - started,
        prompt_keys=[p.key for p in prompts],
        reference={"prompts": len(sample), "indices": sample})
    _publish(storage, report)
    return report


def _matches(outputs: list[list[int]], reference: dict[int, list[int]]) -> int:
    """Sampled prompts whose outputs equal the independent reference's."""
    differ = [i for i, tokens in reference.items() if outputs[i] != tokens]
    if differ:
        i = differ[0]
        pairs = zip(outputs[i], reference[i], strict=False)  # one may stop earlier
        at = next((t for t, (a, b) in enumerate(pairs) if a != b),
                  min(len(outputs[i]), len(reference[i])))
        log.warning("%d of %d sampled prompts differ from the cache-free greedy reference "
                    "(first: prompt %d at generated token %d)", len(differ), len(reference),
                    i, at)
    return len(reference) - len(differ)


def read_report(storage: Storage, step: int) -> AcceptanceReport | None:
    """The committed report of ``step``, or None."""
    prefix = eval_prefix(step)
    manifest = read_manifest(storage, prefix)
    if manifest is None or manifest.kind != EVAL_KIND:
        return None
    return from_json(AcceptanceReport, read_verified(storage, prefix, manifest, REPORT_FILE))


def tau_history(storage: Storage) -> dict[str, dict[int, float]]:
    """τ per contestant per evaluated refresh step, from every committed report."""
    out: dict[str, dict[int, float]] = {}
    for step in steps_of(storage.list_dirs(EVALS)):
        report = read_report(storage, step)
        if report is None:
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


def _load_target(storage: Storage, step: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    local = fetch(storage, policy_prefix(step), kind=POLICY_KIND, label="policy")  # verified
    return AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32).eval()


def _files_digest(manifest: Manifest) -> str:
    return _sha256(sorted([f.path, f.sha256] for f in manifest.files))


def _sha256(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
