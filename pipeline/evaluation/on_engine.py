"""The ``sglang`` evaluator: the serving engine judges. One SGLang server per contestant is
started from the deployment's launch template (:mod:`.servers`) on the refresh step's policy,
the held-out prompts are sent at the rollouts' sampler with per-prompt seeds, and τ comes
from SGLang's own counters (``completion_tokens``, ``spec_verify_ct``:
:mod:`.sglang_mode`).

Order: each drafter's server, then the no-drafter server; each is stopped before the next
starts, so one contestant holds the GPUs at a time.

Checks before a number counts (each failure a named error; nothing is published):

- a drafter's server reports ``speculative_algorithm`` EAGLE3, the drafter directory it was
  given (the same path, or one of the same name where the template mounts it elsewhere) and
  the settings asked for; the no-drafter server reports no speculative algorithm;
- every server reports the same SGLang version;
- a drafter that accepted no draft token in :data:`MIN_PASSES` or more verify passes is not
  drafting with what it was given (a wrong or broken load: τ = 1 exactly):
  :class:`DrafterNotDrafting`, never a number the gate could promote on;
- a server whose process exits mid-measurement is an ``EngineDiedError`` with its log.

Lossless on an engine: each drafter's greedy outputs must equal the no-drafter server's on the
checked prompts (all when the regime is greedy, the reference sample when it is sampled).
The no-drafter server is the reference there (the report's ``reference.prompts`` is 0: no
cache-free loop runs, the engine is not in this process). An engine returns no logits here,
so no mismatch is excused as a near-tie.

The report records the evaluator: engine, version, executable and the server arguments
that decide the numbers (never secrets such as ``api_key``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.confidence import tau_interval
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.contest import NO_DRAFTER, Contestant, Measurement
from pipeline.evaluation.metrics import AcceptanceStats
from pipeline.evaluation.reference import reference_sample
from pipeline.evaluation.servers import EngineServers, LaunchedServer, launched
from pipeline.evaluation.sglang_mode import (
    ServerAcceptance,
    SpeculativeConfigError,
    decode_plain,
    measure_server_acceptance,
)
from pipeline.layout import policy_prefix
from pipeline.records import to_dict
from pipeline.sampling import GREEDY, SamplingParams
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import fetch

log = logging.getLogger(__name__)

T = TypeVar("T")
ENGINE = "sglang"
MIN_PASSES = 8  # verify passes after which accepting nothing means no drafting
# server_info keys the report keeps: what decides the numbers, never a secret
RECORDED_ARGS = ("model_path", "tp_size", "dp_size", "ep_size", "pp_size", "dtype",
                 "kv_cache_dtype", "attention_backend", "sampling_backend", "random_seed",
                 "enable_deterministic_inference", "disable_radix_cache")


class DrafterNotDrafting(RuntimeError):
    """A drafter's server accepted no draft token at all: it is not drafting with it."""


def speculative_args(drafter: Path, params: SpecParams) -> list[str]:
    """SGLang's launch flags that serve ``drafter`` with ``params``."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter),
            "--speculative-num-steps", str(params.num_steps),
            "--speculative-eagle-topk", str(params.eagle_topk),
            "--speculative-num-draft-tokens", str(params.num_draft_tokens)]


def measure_on_sglang(storage: Storage, step: int, ids: list[list[int]], config: EvalConfig,
                      sampler: SamplingParams, source: str,
                      drafters: Mapping[str, tuple[Path, str | None, str | None]],
                      servers: EngineServers) -> Measurement:
    """No drafter and each of ``drafters`` measured on SGLang servers started from
    ``servers`` (module docstring); nothing is published."""
    policy_dir = fetch(storage, policy_prefix(step), kind=POLICY_KIND, label="policy")
    params = config.spec_params(_architectures(policy_dir))
    max_new = config.max_new_tokens
    sample = reference_sample([len(p) for p in ids], config.reference_prompts)
    checked = list(range(len(ids))) if sampler.greedy else sample
    log.info("step %d: measuring on %s at %s (%s) on %d prompts", step, ENGINE,
             sampler.label, source, len(ids))
    runs: dict[str, tuple[ServerAcceptance, dict[int, tuple[int, ...]]]] = {}
    infos: dict[str, dict[str, Any]] = {}
    client = {"concurrency": servers.concurrency, "timeout": servers.request_timeout_s}
    with _log_dir(servers) as logs:
        for name, (directory, _, _) in drafters.items():
            with launched(servers, f"{ENGINE} server for {name}", policy_dir,
                          speculative_args(directory, params), logs) as server:
                infos[name] = _checked(server, lambda s, d=directory: _check_drafter_server(
                    s, d, params))
                run = _checked(server, lambda s: measure_server_acceptance(
                    s.url, ids, max_new, sampler=sampler, seed=config.seed,
                    return_outputs=True, **client))
                greedy = run if sampler.greedy else _checked(
                    server, lambda s: measure_server_acceptance(
                        s.url, [ids[i] for i in checked], max_new, return_outputs=True,
                        **client))
                runs[name] = run, dict(zip(checked, greedy.outputs or (), strict=True))
                _check_drafting(server.label, run)
        with launched(servers, f"{ENGINE} server without a drafter", policy_dir, [],
                      logs) as server:
            infos[NO_DRAFTER] = _checked(server, _check_plain_server)
            base = _checked(server, lambda s: decode_plain(
                s.url, ids, max_new, sampler=sampler, seed=config.seed, **client))
            base_greedy = base if sampler.greedy else _checked(server, lambda s: decode_plain(
                s.url, [ids[i] for i in checked], max_new, sampler=GREEDY, **client))
    expected = dict(zip(checked, base_greedy, strict=True))
    contestants = {NO_DRAFTER: _baseline(base, len(checked), config.confidence)}
    for name, (_, uri, fingerprint) in drafters.items():
        run, greedy = runs[name]
        contestants[name] = _contestant(name, uri, fingerprint, run, params, greedy, expected,
                                        config.confidence)
    return Measurement(contestants, {**asdict(params), "max_new_tokens": max_new},
                       checked=checked, sample=sample, reference_prompts=0, device=ENGINE,
                       evaluator=_record(infos, servers))


def _architectures(policy_dir: Path) -> list[str] | None:
    config = json.loads((policy_dir / "config.json").read_text())
    return config.get("architectures") if isinstance(config, dict) else None


@contextlib.contextmanager
def _log_dir(servers: EngineServers) -> Iterator[Path]:
    if servers.log_dir:
        path = Path(servers.log_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="aerie-eval-servers-") as tmp:
            yield Path(tmp)


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


def _server_info(server: LaunchedServer) -> dict[str, Any]:
    import requests

    r = requests.get(server.url + "/server_info", timeout=30)
    if r.status_code == 404:
        r = requests.get(server.url + "/get_server_info", timeout=30)
    r.raise_for_status()
    info = r.json()
    if not isinstance(info, dict):
        raise SpeculativeConfigError(f"{server.label}: /server_info is not an object")
    return info


def _check_drafter_server(server: LaunchedServer, drafter: Path, params: SpecParams
                          ) -> dict[str, Any]:
    info = _server_info(server)
    algorithm, path = info.get("speculative_algorithm"), info.get("speculative_draft_model_path")
    if str(algorithm).upper() != "EAGLE3" or not path:
        raise SpeculativeConfigError(
            f"{server.label} came up without speculative decoding (server_info: "
            f"speculative_algorithm={algorithm!r}, speculative_draft_model_path={path!r}); "
            f"the launch template must pass {{speculative_args}} to SGLang")
    if str(path) != str(drafter) and Path(str(path)).name != drafter.name:
        raise SpeculativeConfigError(f"{server.label} loaded the drafter {path}, not the one it "
                                     f"was given ({drafter})")
    reported = (info.get("speculative_num_steps"), info.get("speculative_eagle_topk"),
                info.get("speculative_num_draft_tokens"))
    if reported != (params.num_steps, params.eagle_topk, params.num_draft_tokens):
        raise SpeculativeConfigError(f"{server.label} runs speculative settings {reported}, "
                                     f"not the {tuple(asdict(params).values())} asked for")
    return info


def _check_plain_server(server: LaunchedServer) -> dict[str, Any]:
    info = _server_info(server)
    if info.get("speculative_algorithm") or info.get("speculative_draft_model_path"):
        raise SpeculativeConfigError(
            f"{server.label} drafts (speculative_algorithm="
            f"{info.get('speculative_algorithm')!r}): the launch template must not add "
            f"speculative flags of its own")
    return info


def _check_drafting(label: str, run: ServerAcceptance) -> None:
    emitted = run.completion_tokens - run.requests
    if run.spec_verify_ct >= MIN_PASSES and emitted == run.spec_verify_ct:
        raise DrafterNotDrafting(
            f"{label} accepted no draft token in {run.spec_verify_ct} verify passes (τ = 1 "
            f"exactly): it is not drafting with the drafter it was given (a wrong or broken "
            f"load); no τ of it can be trusted")


def _contestant(name: str, uri: str | None, fingerprint: str | None, run: ServerAcceptance,
                params: SpecParams, greedy: dict[int, tuple[int, ...]],
                expected: dict[int, tuple[int, ...]], confidence: float) -> Contestant:
    stats = AcceptanceStats.from_totals(
        params.num_steps, prompts=run.requests, cycles=run.spec_verify_ct,
        emitted_tokens=run.completion_tokens - run.requests)
    match = sum(greedy[i] == tokens for i, tokens in expected.items())
    if match < len(expected):
        log.warning("%s emitted other tokens than the server without a drafter on %d of %d "
                    "prompts", name, len(expected) - match, len(expected))
    per_prompt = [list(p) for p in run.per_prompt]
    return Contestant(name, uri, fingerprint, to_dict(stats), match, 0, per_prompt,
                      list(tau_interval(per_prompt, confidence)))


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


def _record(infos: Mapping[str, dict[str, Any]], servers: EngineServers) -> dict[str, Any]:
    versions = {name: info.get("version") for name, info in infos.items()}
    if len(set(versions.values())) > 1:
        raise SpeculativeConfigError(f"the evaluation servers run different {ENGINE} "
                                     f"versions {versions}: their counts are not comparable")
    base = infos[NO_DRAFTER]
    return {"kind": ENGINE, "engine": ENGINE, "version": versions[NO_DRAFTER],
            **servers.record(),
            "server_args": {k: base[k] for k in RECORDED_ARGS if k in base}}
