"""Acceptance measured on running SGLang servers ("SGLang mode" of acceptance evaluation).

Where :func:`pipeline.evaluation.engine.evaluate` decodes in-process, this module asks SGLang
servers launched with an EAGLE-3 drafter (``--speculative-algorithm EAGLE3
--speculative-draft-model-path ...``; docs/sglang.md) to decode the prompts and reads the
counts SGLang reports per finished request (SGLang 0.5.21–0.5.23, sources in docs/sglang.md):

- ``meta_info.completion_tokens``: generated tokens, the prefill token included;
- ``meta_info.spec_verify_ct``: verify passes (target forwards over a draft tree); the
  prefill is not one. A request that stopped at its prefill token has 0, and SGLang's newest
  ``fill_spec_decoding_meta`` then omits the key.

Steps of :func:`measure_server_acceptance`: read every server's ``/server_info`` (refuse a
server that does not decode with an EAGLE-3 drafter, or whose settings differ from the
others'); ``/flush_cache`` each (which also zeroes SGLang's ``avg_spec_accept_length``
counters); send each prompt as its own request at the evaluation's sampler (``temperature:
0`` when greedy; else ``temperature``/``top_p``/``top_k``/``min_p`` and a per-prompt
``sampling_seed``), round-robin over the URLs (a retry fails over to the next); validate
every answer; sum the counts per server and overall; read ``/server_info`` again for the
servers' own running average.

Sampling on a real server (docs/speculative-sampling.md): SGLang verifies at temperature > 0
with the same walk as the in-process engine and ignores ``min_p`` there too. Its
verification coins follow ``sampling_seed`` only under ``--enable-deterministic-inference``
and only in releases with PR #30822 (after 2026-07); elsewhere they come from the server's
global RNG, so a sampled τ repeats only in distribution. Either way the per-prompt counts
give an interval computed as the in-process report's (other draws, the same method).

Invariants:

- Ratios are computed from sums only: ``accept_length = Σcompletion_tokens /
  Σspec_verify_ct`` (SGLang's benchmark formula, equal to Aerie's
  ``AcceptanceStats.server_accept_length``) and ``tau = (Σcompletion_tokens - requests) /
  Σspec_verify_ct`` (Aerie's τ: the prefill token, one per request, is not a cycle's). Counts
  summed over several servers equal those of one server given all the prompts.
- Every answer is checked before it counts: ``1 <= completion_tokens <= max_new_tokens``,
  ``len(output_ids) == completion_tokens``, ``spec_verify_ct >= 1`` unless the request stopped
  at its prefill token (``completion_tokens == 1``), and no verify pass emitting more than
  ``num_steps + 1`` tokens. A bad answer is retried like a transport failure; the final
  :class:`ServerAcceptanceError` names the URL and the prompt index.
- No pickle: :meth:`ServerAcceptance.to_dict` / :meth:`ServerAcceptance.from_dict` round-trip
  through JSON-safe values.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from pipeline.algorithms import ALGORITHMS, served_name_known
from pipeline.capture.engine_http import (
    CallStats,
    EngineConfigError,
    EngineRequestError,
    JsonHttp,
    RetryPolicy,
    TransientFailure,
    call_with_retries,
    json_int,
    post_each,
    raise_for_status,
)
from pipeline.eagle3.spec import SpecParams
from pipeline.sampling import GREEDY, SamplingParams, prompt_seed

__all__ = ["SCHEMA_VERSION", "SPEC_FLAGS", "ServerAcceptance", "ServerAcceptanceError",
           "ServerCounts", "SpeculativeConfigError", "decode_all", "measure_server_acceptance",
           "parse_spec_response", "sampling_params", "server_info"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
SCHEMA_VERSION = 2  # 2: sampler, per_prompt
READABLE_SCHEMA_VERSIONS = (1, 2)
SPEC_FLAGS = ("--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR "
              "--speculative-num-steps N --speculative-eagle-topk K "
              "--speculative-num-draft-tokens D")
_SETTING_KEYS = ("speculative_num_steps", "speculative_eagle_topk",
                 "speculative_num_draft_tokens")


class SpeculativeConfigError(EngineConfigError):
    """A server does not decode with an EAGLE-3 drafter, or the servers disagree."""


class ServerAcceptanceError(EngineRequestError):
    """A prompt failed for good; ``url`` is the last server tried, ``prompt`` its index."""

    def __init__(self, message: str, *, url: str, prompt: int,
                 attempts: Sequence[str] = ()) -> None:
        super().__init__(message, url=url, samples=[prompt], attempts=attempts)
        self.prompt = prompt


@dataclass(frozen=True)
class ServerCounts:
    """One server's share of a measurement."""

    url: str
    requests: int
    completion_tokens: int
    spec_verify_ct: int
    server_info_accept_length: float | None  # its avg_spec_accept_length after the run


@dataclass(frozen=True)
class ServerAcceptance:
    """Summed counts of one measurement and the settings the servers reported."""

    urls: tuple[str, ...]
    max_new_tokens: int
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    draft_model_path: str
    sglang_version: str | None
    requests: int
    completion_tokens: int
    spec_verify_ct: int
    stopped: int  # requests that ended on a stop token (finish_reason "stop")
    # Verify-weighted mean of the servers' avg_spec_accept_length; None if any lacks it.
    server_info_accept_length: float | None
    per_server: tuple[ServerCounts, ...]
    outputs: tuple[tuple[int, ...], ...] | None = None  # per prompt, with return_outputs
    sampler: dict[str, Any] = field(default_factory=GREEDY.to_dict)  # what was asked for
    per_prompt: tuple[tuple[int, int], ...] = ()  # (emitted by verify passes, verify passes)

    @property
    def accept_length(self) -> float:
        """Σcompletion_tokens / Σspec_verify_ct: SGLang's formula, prefill token included."""
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else math.nan

    @property
    def tau(self) -> float:
        """Aerie's τ: tokens per verify pass, the prefill tokens (one per request) excluded."""
        return ((self.completion_tokens - self.requests) / self.spec_verify_ct
                if self.spec_verify_ct else math.nan)

    @property
    def spec_params(self) -> SpecParams:
        return SpecParams(self.num_steps, self.eagle_topk, self.num_draft_tokens)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "urls":
                value = list(value)
            elif f.name == "per_server":
                value = [{g.name: getattr(c, g.name) for g in fields(c)} for c in value]
            elif f.name in ("outputs", "per_prompt") and value is not None:
                value = [list(o) for o in value]
            out[f.name] = value
        out["accept_length"] = self.accept_length  # derived, for readers of the JSON
        out["tau"] = self.tau
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ServerAcceptance:
        raw = dict(raw)
        version = raw.pop("schema_version", None)
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(f"server acceptance schema version {version!r}, expected one of "
                             f"{READABLE_SCHEMA_VERSIONS}")
        derived = {k: raw.pop(k, None) for k in ("accept_length", "tau")}
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown server acceptance fields {sorted(unknown)}")
        raw["urls"] = tuple(raw["urls"])
        raw["per_server"] = tuple(ServerCounts(**c) for c in raw["per_server"])
        for name in ("outputs", "per_prompt"):
            if raw.get(name) is not None:
                raw[name] = tuple(tuple(o) for o in raw[name])
        out = cls(**raw)
        for name, value in derived.items():
            mine = getattr(out, name)
            if value is not None and not (value == mine or (math.isnan(mine)
                                                            and math.isnan(value))):
                raise ValueError(f"{name} {value} disagrees with the counts ({mine})")
        return out


@dataclass(frozen=True)
class Answer:
    completion_tokens: int
    spec_verify_ct: int
    stopped: bool
    output_ids: tuple[int, ...]


def parse_spec_response(body: Any, *, max_new_tokens: int, num_steps: int) -> Answer:
    """Validate one ``/generate`` answer for a single prompt (module invariants).

    Raises :class:`TransientFailure` (retried by the caller) describing the first problem.
    """
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise TransientFailure(f"malformed answer: no meta_info object ({str(body)[:80]})")
    completion = meta.get("completion_tokens")
    if not json_int(completion) or not 1 <= completion <= max_new_tokens:
        raise TransientFailure(f"malformed answer: completion_tokens {completion!r} is not in "
                               f"[1, max_new_tokens={max_new_tokens}]")
    output = body.get("output_ids")
    if not isinstance(output, list) or not all(json_int(t) for t in output):
        raise TransientFailure("malformed answer: output_ids is not a list of token ids")
    if len(output) != completion:
        raise TransientFailure(f"malformed answer: {len(output)} output_ids for "
                               f"completion_tokens {completion}")
    verify = meta.get("spec_verify_ct", 0 if completion == 1 else None)
    if verify is None:
        raise TransientFailure(f"malformed answer: no meta_info.spec_verify_ct for "
                               f"{completion} generated tokens (is speculative decoding on?)")
    if not json_int(verify) or verify < (1 if completion > 1 else 0):
        raise TransientFailure(f"malformed answer: spec_verify_ct {verify!r} for {completion} "
                               f"generated tokens (every token after the first comes from a "
                               f"verify pass)")
    if completion - 1 > verify * (num_steps + 1):
        raise TransientFailure(f"inconsistent answer: {completion - 1} tokens from {verify} "
                               f"verify passes, more than num_steps + 1 = {num_steps + 1} each")
    reason = meta.get("finish_reason")
    stopped = isinstance(reason, dict) and reason.get("type") == "stop"
    return Answer(completion, verify, stopped, tuple(output))


def measure_server_acceptance(urls: str | Sequence[str], prompts: Sequence[Sequence[int]],
                              max_new_tokens: int, *, concurrency: int = 8,
                              timeout: float = 600.0, retries: int = 3,
                              backoff_s: float = 0.5, ignore_eos: bool = False,
                              return_outputs: bool = False, api_key: str | None = None,
                              sampler: SamplingParams = GREEDY, seed: int | None = 0,
                              flush: bool = True) -> ServerAcceptance:
    """Decode ``prompts`` on the servers at ``urls`` and sum their acceptance counts.

    ``urls``: ``http(s)://host:port`` (a string is read as a comma-separated list); prompts
    go round-robin over them. ``timeout``: seconds one request may take; ``retries``: extra
    attempts per request (also for ``/server_info`` and ``/flush_cache``). ``ignore_eos``
    is passed to SGLang (decode to ``max_new_tokens``). ``return_outputs`` keeps each prompt's
    generated ids in the result. ``sampler``: greedy by default; a sampled one sends prompt
    i ``sampling_seed = prompt_seed(seed, i)`` (the in-process engine's seeds; None sends
    no seed). ``flush`` False leaves the servers' caches and counters alone (servers busy
    with other requests refuse ``/flush_cache``; the per-request counts do not need it).
    Raises :class:`SpeculativeConfigError` for servers without
    EAGLE-3 decoding and :class:`ServerAcceptanceError` when a prompt fails for good.
    """
    urls = _clean_urls(urls)
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("need at least one prompt, each of at least one token")
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (one token comes from the prefill, the "
                         f"rest from verify passes), got {max_new_tokens}")
    if concurrency < 1 or retries < 0 or timeout <= 0:
        raise ValueError("concurrency >= 1, retries >= 0 and timeout > 0 required")
    http = JsonHttp(timeout_s=timeout, connect_timeout_s=min(10.0, timeout), api_key=api_key)
    policy = RetryPolicy(max_retries=retries, backoff_s=backoff_s)
    stats = CallStats()
    counter = itertools.count(len(prompts))  # request indices of the per-URL calls
    try:
        def on_each(what: str, fn: Callable[[str], T]) -> list[T]:
            return [call_with_retries(fn, urls=[url], request_index=next(counter),
                                      policy=policy, stats=stats, what=f"{what} of {url}",
                                      samples=[])
                    for url in urls]

        infos = on_each("server info", lambda url: server_info(http, url))
        settings = _check_settings(urls, infos)
        if flush:
            on_each("cache flush", lambda url: _flush(http, url))
        requests = [sampling_params(sampler, seed, i, max_new_tokens, ignore_eos)
                    for i in range(len(prompts))]
        num_steps = settings["num_steps"]
        answers = decode_all(http, urls, prompts, requests, concurrency, policy, stats,
                              lambda body: parse_spec_response(
                                  body, max_new_tokens=max_new_tokens, num_steps=num_steps))
        after = on_each("server info", lambda url: server_info(http, url))
    finally:
        http.close()
    return _summarise(urls, settings, max_new_tokens, answers, after, return_outputs,
                      sampler)


def sampling_params(sampler: SamplingParams, seed: int | None, index: int,
                     max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Prompt ``index``'s ``sampling_params``: SGLang's names, greedy as ``temperature 0``."""
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if sampler.greedy:
        out["temperature"] = 0
    else:
        out.update(sampler.to_dict())
        if seed is not None:
            out["sampling_seed"] = prompt_seed(seed, index)
    if ignore_eos:
        out["ignore_eos"] = True
    return out


def decode_all(http: JsonHttp, urls: tuple[str, ...], prompts: list[list[int]],
                requests: list[dict[str, Any]], concurrency: int, policy: RetryPolicy,
                stats: CallStats, parse: Callable[[Any], Answer]
                ) -> list[tuple[str, Answer]]:
    """(answering URL, answer) per prompt, in prompt order; the first failure is raised."""
    payloads = [{"input_ids": p, "sampling_params": r}
                for p, r in zip(prompts, requests, strict=True)]
    try:
        return post_each(http, urls, "/generate", payloads, parse, concurrency=concurrency,
                         policy=policy, stats=stats, what="acceptance request")
    except EngineRequestError as e:
        i = e.samples[0]
        raise ServerAcceptanceError(f"prompt {i} (last server {e.url}): {e}", url=e.url,
                                    prompt=i, attempts=e.attempts) from e


def _summarise(urls: tuple[str, ...], settings: dict[str, Any], max_new_tokens: int,
               answers: list[tuple[str, Answer]], after: list[Any], return_outputs: bool,
               sampler: SamplingParams) -> ServerAcceptance:
    per_server = []
    for url, info in zip(urls, after, strict=True):
        mine = [a for u, a in answers if u == url]
        per_server.append(ServerCounts(
            url=url, requests=len(mine),
            completion_tokens=sum(a.completion_tokens for a in mine),
            spec_verify_ct=sum(a.spec_verify_ct for a in mine),
            server_info_accept_length=_avg_accept_length(info)))
    verify = sum(c.spec_verify_ct for c in per_server)
    if verify == 0:
        raise EngineRequestError("no request reached a verify pass (every one stopped at its "
                                 "prefill token): the accept length is undefined",
                                 url=urls[0], samples=range(len(answers)))
    weighted = [(c.server_info_accept_length, c.spec_verify_ct) for c in per_server
                if c.spec_verify_ct]
    server_avg = (None if any(v is None for v, _ in weighted)
                  else sum(v * n for v, n in weighted) / sum(n for _, n in weighted))
    result = ServerAcceptance(
        urls=urls, max_new_tokens=max_new_tokens, **settings,
        requests=len(answers), completion_tokens=sum(a.completion_tokens for _, a in answers),
        spec_verify_ct=verify, stopped=sum(a.stopped for _, a in answers),
        server_info_accept_length=server_avg, per_server=tuple(per_server),
        outputs=tuple(a.output_ids for _, a in answers) if return_outputs else None,
        sampler=sampler.canonical().to_dict(),
        per_prompt=tuple((a.completion_tokens - 1, a.spec_verify_ct) for _, a in answers))
    logger.info("SGLang acceptance (%s) over %d prompts on %d server(s): accept length %.4f "
                "(tau %.4f), server avg_spec_accept_length %s", sampler.label, result.requests,
                len(urls), result.accept_length, result.tau, server_avg)
    return result


# -- server calls ----------------------------------------------------------------------


def server_info(http: JsonHttp, url: str) -> dict[str, Any]:
    info = http.get_json(url, "/server_info") or http.get_json(url, "/get_server_info")
    if not isinstance(info, dict):
        raise SpeculativeConfigError(f"server at {url} exposes no /server_info: cannot check "
                                     f"that it decodes with an EAGLE-3 drafter")
    return info


def _flush(http: JsonHttp, url: str) -> None:
    """``/flush_cache``; SGLang answers HTTP 400 while requests run or wait: retried."""
    status, content = http.fetch("POST", url, "/flush_cache")
    if status == 400:
        raise TransientFailure(f"flush_cache refused (HTTP 400: "
                               f"{content[:100].decode(errors='replace').strip()}): the server "
                               f"has running or waiting requests")
    raise_for_status(status, content, url + "/flush_cache")


def _check_settings(urls: tuple[str, ...], infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The common speculative settings of all servers, or a :class:`SpeculativeConfigError`."""
    found = []
    for url, info in zip(urls, infos, strict=True):
        algorithm = info.get("speculative_algorithm")
        draft = info.get("speculative_draft_model_path")
        if not served_name_known(sglang_algorithm=algorithm) or not draft:
            raise SpeculativeConfigError(
                f"server at {url} does not decode with a drafter of an algorithm Aerie "
                f"knows ({sorted(ALGORITHMS)}) "
                f"(server_info: speculative_algorithm={algorithm!r}, "
                f"speculative_draft_model_path={draft!r}); launch it with {SPEC_FLAGS} "
                f"(docs/sglang.md)")
        numbers = [info.get(k) for k in _SETTING_KEYS]
        if not all(json_int(n) and n >= 1 for n in numbers):
            raise SpeculativeConfigError(
                f"server at {url} reports speculative settings "
                f"{dict(zip(_SETTING_KEYS, numbers, strict=True))}; expected positive integers")
        served = next(a for a in ALGORITHMS.values()
                      if a.sglang_algorithm == str(algorithm).upper())
        params = served.from_sglang_reported(*numbers)  # DFlash: its block's chain
        found.append({"num_steps": params.num_steps, "eagle_topk": params.eagle_topk,
                      "num_draft_tokens": params.num_draft_tokens,
                      "draft_model_path": str(draft), "sglang_version": info.get("version")})
    differing = [url for url, f in zip(urls, found, strict=True)
                 if {k: v for k, v in f.items() if k != "sglang_version"}
                 != {k: v for k, v in found[0].items() if k != "sglang_version"}]
    if differing:
        raise SpeculativeConfigError(
            f"servers disagree on the drafter or its settings: {urls[0]} has {found[0]}, "
            f"{differing[0]} has {found[urls.index(differing[0])]}; counts of different "
            f"settings cannot be summed")
    return found[0]


def _avg_accept_length(info: Any) -> float | None:
    """``avg_spec_accept_length``: the mean over ``internal_states`` (one per DP rank, as
    SGLang's own tests average it), or the top-level key of older releases; None if absent."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    values = [s["avg_spec_accept_length"] for s in states
              if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"),
                                                    (int, float))] \
        if isinstance(states, list) else []
    if not values and isinstance(info.get("avg_spec_accept_length"), (int, float)):
        values = [info["avg_spec_accept_length"]]
    return sum(values) / len(values) if values else None


def _clean_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = urls.split(",")
    cleaned = tuple(u.strip().rstrip("/") for u in urls if u.strip())
    if not cleaned or not all(u.startswith(("http://", "https://")) for u in cleaned):
        raise ValueError(f"urls must be a non-empty list of http(s) URLs, got {cleaned}")
    return cleaned
