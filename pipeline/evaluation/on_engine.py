"""The engine evaluators (``sglang``, ``vllm``): the serving engine judges. One server per
contestant is started from the deployment's launch template (:mod:`.servers`) on the refresh
step's policy, the held-out prompts are sent at the rollouts' sampler with per-prompt seeds,
and τ comes from the engine's own counters (:mod:`.sglang_engine`, :mod:`.vllm_engine`).

Order: each drafter's server, then the no-drafter server; each is stopped before the next
starts, so one contestant holds the GPUs at a time.

Checks before a number counts (each failure a named error; nothing is published):

- a drafter's server drafts with the drafter it was given at the settings asked for, and the
  no-drafter server does not draft (each engine's ``check_drafter``/``check_plain``);
- every server reports the same engine version (checked as each starts:
  :class:`EngineVersionMismatch`);
- a drafter that accepted no draft token in :data:`MIN_PASSES` or more verify passes is not
  drafting with what it was given (a wrong or broken load: τ = 1 exactly):
  :class:`DrafterNotDrafting`, never a number the gate could promote on;
- a server whose process exits mid-measurement is an ``EngineDiedError`` with its log.

Lossless on an engine: each drafter's greedy outputs must equal the no-drafter server's on the
checked prompts (all when the regime is greedy, the reference sample when it is sampled).
The no-drafter server is the reference there (the report's ``reference.prompts`` is 0: no
cache-free loop runs, the engine is not in this process). A divergence counts as a near-tie
(``Contestant.ties``), not a failure, when the no-drafter server ranks the two tokens as its
two likeliest at most ``EngineServers.tie_nats`` apart in log-probability (its top-2
log-probabilities after the common prefix; :func:`_near_ties`).

The report records the evaluator: engine, version, executable and the server arguments
that decide the numbers (never secrets such as ``api_key``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

from pipeline.algorithms import read_config, serving_of
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.confidence import tau_interval
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.contest import NO_DRAFTER, Contestant, Measurement, reference_sample
from pipeline.evaluation.engine_api import EngineAPI, EngineRun
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.servers import EngineServers, LaunchedServer, launched
from pipeline.evaluation.sglang_mode import SpeculativeConfigError
from pipeline.layout import policy_prefix
from pipeline.records import to_dict
from pipeline.sampling import GREEDY, SamplingParams
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import fetch

log = logging.getLogger(__name__)

T = TypeVar("T")
MIN_PASSES = 32  # verify passes after which accepting nothing means no drafting


class DrafterNotDrafting(RuntimeError):
    """A drafter's server accepted no draft token at all: it is not drafting with it."""


class EngineVersionMismatch(RuntimeError):
    """The evaluation servers of one measurement run different engine versions."""


def measure_on_engine(engine: EngineAPI, storage: Storage, step: int, ids: list[list[int]],
                      config: EvalConfig, sampler: SamplingParams, source: str,
                      drafters: Mapping[str, tuple[Path, str | None, str | None]],
                      servers: EngineServers) -> Measurement:
    """No drafter and each of ``drafters`` measured on ``engine``'s servers started from
    ``servers`` (module docstring); nothing is published."""
    policy_dir = fetch(storage, policy_prefix(step), kind=POLICY_KIND, label="policy")
    params = config.spec_params(_architectures(policy_dir))
    max_new = config.max_new_tokens
    sample = reference_sample([len(p) for p in ids], config.reference_prompts)
    checked = list(range(len(ids))) if sampler.greedy else sample
    log.info("step %d: measuring on %s at %s (%s) on %d prompts", step, engine.name,
             sampler.label, source, len(ids))
    runs: dict[str, tuple[EngineRun, dict[int, tuple[int, ...]]]] = {}
    infos: dict[str, dict[str, Any]] = {}
    client = {"concurrency": servers.concurrency, "timeout": servers.request_timeout_s}
    subset = [ids[i] for i in checked]
    served = {name: _served_as(directory, params)
              for name, (directory, _, _) in drafters.items()}  # as its algorithm serves it
    with _log_dir(servers) as logs:
        for name, (directory, _, _) in drafters.items():
            own = served[name]
            with launched(servers, f"{engine.name} server for {name}", policy_dir,
                          engine.speculative_args(directory, own), logs) as server:
                info = infos[name] = _checked(server, lambda s: engine.server_info(s.url))
                _check_version(engine, server.label, infos)
                engine.check_drafter(server.label, info, directory, own)
                run = _checked(server, lambda s, p=own: engine.speculate(
                    s.url, ids, max_new, sampler, config.seed, p, **client))
                greedy = run if sampler.greedy else _checked(server, lambda s, p=own: (
                    engine.speculate(s.url, subset, max_new, GREEDY, config.seed, p, **client)))
                runs[name] = run, dict(zip(checked, greedy.outputs, strict=True))
                _check_drafting(server.label, run, name)
        with launched(servers, f"{engine.name} server without a drafter", policy_dir, [],
                      logs) as server:
            info = infos[NO_DRAFTER] = _checked(server, lambda s: engine.server_info(s.url))
            _check_version(engine, server.label, infos)
            engine.check_plain(server.label, info)
            base = _checked(server, lambda s: engine.decode(
                s.url, ids, max_new, sampler, config.seed, **client))
            base_greedy = base if sampler.greedy else _checked(server, lambda s: engine.decode(
                s.url, subset, max_new, GREEDY, config.seed, **client))
            expected = dict(zip(checked, base_greedy, strict=True))
            ties = {name: _checked(server, lambda s, g=greedy: _near_ties(
                engine, s.url, ids, g, expected, servers))
                for name, (_, greedy) in runs.items()}
    contestants = {NO_DRAFTER: _baseline(base, len(checked), config.confidence)}
    for name, (_, uri, fingerprint) in drafters.items():
        run, greedy = runs[name]
        contestants[name] = replace(
            _contestant(name, uri, fingerprint, run, served[name], greedy, expected,
                        config.confidence, ties[name]),
            settings=None if served[name] == params else asdict(served[name]))
    return Measurement(contestants, {**asdict(params), "max_new_tokens": max_new},
                       checked=checked, sample=sample, reference_prompts=0,
                       device=engine.name, dtype=str(engine.dtype(infos[NO_DRAFTER])),
                       evaluator=_record(engine, infos, servers))


def _architectures(policy_dir: Path) -> list[str] | None:
    config = json.loads((policy_dir / "config.json").read_text())
    return config.get("architectures") if isinstance(config, dict) else None


@contextlib.contextmanager
def _log_dir(servers: EngineServers) -> Iterator[Path]:
    """``servers.log_dir``, else a temporary directory removed on success only (an error
    names a log in it)."""
    if servers.log_dir:
        path = Path(servers.log_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="aerie-eval-servers-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _checked(server: LaunchedServer, call: Callable[[LaunchedServer], T]) -> T:
    """``call(server)``; a failure of a server whose process exited is reported as its
    death, with its log."""
    try:
        return call(server)
    except Exception as e:
        explained = server.explain(e)
        if explained is e:
            raise
        raise explained from e


def _check_version(engine: EngineAPI, label: str, infos: Mapping[str, dict[str, Any]]
                   ) -> None:
    """Every server so far runs the first one's engine version (checked as each starts)."""
    versions = {name: engine.version(info) for name, info in infos.items()}
    if len(set(versions.values())) > 1:
        raise EngineVersionMismatch(f"{label} runs {engine.name} {list(versions.values())[-1]}"
                                    f", the servers before it {versions}: counts of "
                                    f"different versions are not comparable")


def _check_drafting(label: str, run: EngineRun, name: str) -> None:
    if run.passes >= MIN_PASSES and run.emitted == run.passes:
        hint = (" If the champion really drafts nothing any more, measure the candidate "
                "against no drafter (acceptance_eval's champion: none)"
                if name == "champion" else "")
        raise DrafterNotDrafting(
            f"{label} accepted no draft token in {run.passes} verify passes (τ = 1 "
            f"exactly): it is not drafting with the drafter it was given (a wrong or broken "
            f"load); no τ of it can be trusted.{hint}")


def _near_ties(engine: EngineAPI, url: str, ids: list[list[int]],
               greedy: dict[int, tuple[int, ...]], expected: dict[int, tuple[int, ...]],
               servers: EngineServers) -> int:
    """Checked prompts whose greedy output first leaves the no-drafter server's at a
    near-tie: the two tokens are that server's two likeliest there, at most
    ``servers.tie_nats`` apart in log-probability. A divergence in length only (one output
    stopped earlier) is never one."""
    if servers.tie_nats <= 0:
        return 0
    ties = 0
    for i, want in expected.items():
        got = greedy[i]
        at = next((t for t, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                  None)
        if at is None:
            continue
        top = engine.top2(url, [*ids[i], *want[:at]], timeout=servers.request_timeout_s)
        tokens = {token for token, _ in top}
        if len(top) == 2 and tokens == {want[at], got[at]} \
                and abs(top[0][1] - top[1][1]) <= servers.tie_nats:
            ties += 1
    return ties


def _contestant(name: str, uri: str | None, fingerprint: str | None, run: EngineRun,
                params: SpecParams, greedy: dict[int, tuple[int, ...]],
                expected: dict[int, tuple[int, ...]], confidence: float, ties: int
                ) -> Contestant:
    stats = AcceptanceStats.from_totals(params.num_steps, prompts=len(run.per_prompt),
                                        cycles=run.passes, emitted_tokens=run.emitted)
    match = sum(greedy[i] == tokens for i, tokens in expected.items())
    if match + ties < len(expected):
        log.warning("%s emitted other tokens than the server without a drafter on %d of %d "
                    "prompts (%d more at near-ties)", name, len(expected) - match - ties,
                    len(expected), ties)
    per_prompt = [list(p) for p in run.per_prompt]
    return Contestant(name, uri, fingerprint, to_dict(stats), match, 0, per_prompt,
                      list(tau_interval(per_prompt, confidence)), ties)


def _baseline(outputs: Sequence[Sequence[int]], checked: int, confidence: float
              ) -> Contestant:
    """No drafter: every token after the prefill's is one forward that emits it."""
    per_prompt = [[len(o) - 1, len(o) - 1] for o in outputs]
    cycles = sum(c for c, _ in per_prompt)
    stats = AcceptanceStats(0, prompts=len(outputs), cycles=cycles, emitted_tokens=cycles,
                            bonus_tokens=cycles, prefill_tokens=len(outputs),
                            accept_hist=[cycles])
    return Contestant(NO_DRAFTER, None, None, to_dict(stats), checked, 0, per_prompt,
                      list(tau_interval(per_prompt, confidence)))


def _record(engine: EngineAPI, infos: Mapping[str, dict[str, Any]], servers: EngineServers
            ) -> dict[str, Any]:
    base = infos[NO_DRAFTER]
    return {"kind": engine.name, "engine": engine.name, "version": engine.version(base),
            **servers.record(),
            "server_args": {k: base[k] for k in engine.recorded_args if k in base}}


def _served_as(directory: Path, params: SpecParams) -> SpecParams:
    """The settings the drafter in ``directory`` is served with (its algorithm's)."""
    try:
        return serving_of(read_config(directory), params, str(directory))[1]
    except ValueError as e:  # an UnknownAlgorithmError too
        raise SpeculativeConfigError(f"the drafter to serve: {e}") from e
