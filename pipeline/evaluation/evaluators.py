"""The evaluators, registered once: who decodes the contestants of an acceptance
evaluation.

``EVALUATORS`` maps a kind to its :class:`EvaluatorKind`:

- ``inprocess``: Aerie's own engine in this process (:mod:`.inprocess`), the default for
  the demo and for targets that fit one device;
- ``sglang``: an SGLang server per contestant, started from the deployment's launch
  template and judged by SGLang's own counters (:mod:`.on_engine`, :mod:`.sglang_engine`);
- ``vllm``: the same with ``vllm serve`` and its per-request spec-decode metrics
  (:mod:`.vllm_engine`).

The evaluator resource's choices and :func:`measure` read this one dict, so a new evaluator
is one module and one entry here. Importing this module loads no torch: an evaluator loads
what it needs when it measures.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.evaluation.servers import EngineServers

if TYPE_CHECKING:
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.contest import Measurement
    from pipeline.sampling import SamplingParams
    from pipeline.storage import Storage

Drafters = Mapping[str, tuple[Path, "str | None", "str | None"]]  # name -> dir, uri, fingerprint


@dataclass(frozen=True)
class Evaluator:
    """Which evaluator measures, and for an engine how its servers start."""

    kind: str = "inprocess"
    servers: EngineServers = field(default_factory=EngineServers)

    def __post_init__(self) -> None:
        if self.kind not in EVALUATORS:
            raise ValueError(f"evaluator {self.kind!r} is not one of {sorted(EVALUATORS)}")
        if EVALUATORS[self.kind].engine:
            self.servers.check(f"the {self.kind} evaluator's launch template")

    @property
    def engine(self) -> str | None:
        return EVALUATORS[self.kind].engine

    def identity(self) -> dict[str, Any] | None:
        """What makes two measurements comparable and enters the report's fingerprint
        (None in process: reports from before evaluators keep their fingerprints). The
        launch template enters as a digest only (it may carry tokens)."""
        if not self.engine:
            return None
        digest = hashlib.sha256(json.dumps(list(self.servers.launch)).encode()).hexdigest()
        return {"kind": self.kind, "launch_sha256": digest, "tie_nats": self.servers.tie_nats}


@dataclass(frozen=True)
class EvaluatorKind:
    measure: Callable[..., Measurement]
    engine: str | None  # the serving engine that judges; None: Aerie's own


def _inprocess(storage: Storage, step: int, ids: list[list[int]], config: EvalConfig,
               sampler: SamplingParams, source: str, drafters: Drafters,
               evaluator: Evaluator) -> Measurement:
    from pipeline.evaluation.inprocess import measure

    return measure(storage, step, ids, config, sampler, source, drafters)


def _sglang(storage: Storage, step: int, ids: list[list[int]], config: EvalConfig,
            sampler: SamplingParams, source: str, drafters: Drafters,
            evaluator: Evaluator) -> Measurement:
    from pipeline.evaluation.on_engine import measure_on_engine
    from pipeline.evaluation.sglang_engine import SGLang

    return measure_on_engine(SGLang(), storage, step, ids, config, sampler, source, drafters,
                             evaluator.servers)


def _vllm(storage: Storage, step: int, ids: list[list[int]], config: EvalConfig,
          sampler: SamplingParams, source: str, drafters: Drafters,
          evaluator: Evaluator) -> Measurement:
    from pipeline.evaluation.on_engine import measure_on_engine
    from pipeline.evaluation.vllm_engine import VLLM

    return measure_on_engine(VLLM(), storage, step, ids, config, sampler, source, drafters,
                             evaluator.servers)


EVALUATORS: dict[str, EvaluatorKind] = {
    "inprocess": EvaluatorKind(_inprocess, engine=None),
    "sglang": EvaluatorKind(_sglang, engine="sglang"),
    "vllm": EvaluatorKind(_vllm, engine="vllm"),
}
INPROCESS = Evaluator()


def label(record: Mapping[str, Any]) -> str:
    """A report's evaluator record in words: ``inprocess``, or e.g. ``sglang 0.5.23``."""
    return " ".join(str(x) for x in (record.get("kind", "inprocess"), record.get("version"))
                    if x)


def measure(evaluator: Evaluator, storage: Storage, step: int, ids: list[list[int]],
            config: EvalConfig, sampler: SamplingParams, source: str,
            drafters: Drafters) -> Measurement:
    """No drafter and each of ``drafters`` measured by ``evaluator`` on the prompts ``ids``
    with the policy of ``step``, at ``sampler`` (recorded as coming from ``source``)."""
    return EVALUATORS[evaluator.kind].measure(storage, step, ids, config, sampler, source,
                                              drafters, evaluator)
