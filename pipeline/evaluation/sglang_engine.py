"""SGLang as the engine evaluator's judge (:mod:`.on_engine`): its launch flags, what its
``/server_info`` must say, its counters (:mod:`.sglang_mode`), decoding without a drafter
and its top log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.algorithms import UnknownAlgorithmError, algorithm_of_directory, served_name_known
from pipeline.capture.engine_http import (
    CallStats,
    JsonHttp,
    RetryPolicy,
    TransientFailure,
    json_int,
)
from pipeline.drafters.algorithm import DrafterAlgorithm
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine_api import EngineRun
from pipeline.evaluation.sglang_mode import (
    Answer,
    SpeculativeConfigError,
    decode_all,
    measure_server_acceptance,
    parse_spec_response,
    sampling_params,
    server_info,
)
from pipeline.sampling import GREEDY, SamplingParams


class SGLang:
    """The ``sglang`` evaluator's engine."""

    name = "sglang"
    # server_info keys the report keeps: what decides the numbers, never a secret
    recorded_args = ("model_path", "tp_size", "dp_size", "ep_size", "pp_size", "dtype",
                     "kv_cache_dtype", "attention_backend", "sampling_backend", "random_seed",
                     "enable_deterministic_inference", "disable_radix_cache")

    def speculative_args(self, drafter: Path, params: SpecParams) -> list[str]:
        return list(_algorithm_of(drafter).sglang_args(params, str(drafter)))

    def server_info(self, url: str) -> dict[str, Any]:
        http = JsonHttp(timeout_s=30.0, connect_timeout_s=10.0)
        try:
            return server_info(http, url)
        finally:
            http.close()

    def check_drafter(self, label: str, info: dict[str, Any], drafter: Path,
                      params: SpecParams) -> None:
        algorithm = info.get("speculative_algorithm")
        path = info.get("speculative_draft_model_path")
        if not served_name_known(sglang_algorithm=algorithm) or not path:
            raise SpeculativeConfigError(
                f"{label} came up without speculative decoding (server_info: "
                f"speculative_algorithm={algorithm!r}, speculative_draft_model_path={path!r}); "
                f"the launch template must pass {{speculative_args}} to SGLang")
        if str(path) != str(drafter) and Path(str(path)).name != drafter.name:
            raise SpeculativeConfigError(f"{label} loaded the drafter {path}, not the one it "
                                         f"was given ({drafter})")
        found = _algorithm_of(drafter)
        if str(algorithm).upper() != found.sglang_algorithm:
            raise SpeculativeConfigError(f"{label} serves its drafter as {algorithm!r}, the "
                                         f"drafter's algorithm is {found.sglang_algorithm}")
        reported = (info.get("speculative_num_steps"), info.get("speculative_eagle_topk"),
                    info.get("speculative_num_draft_tokens"))
        if reported != found.sglang_reported(params):
            raise SpeculativeConfigError(f"{label} runs speculative settings {reported}, not "
                                         f"the {found.sglang_reported(params)} of the "
                                         f"{tuple(asdict(params).values())} asked for")

    def check_plain(self, label: str, info: dict[str, Any]) -> None:
        if info.get("speculative_algorithm") or info.get("speculative_draft_model_path"):
            raise SpeculativeConfigError(
                f"{label} drafts (speculative_algorithm={info.get('speculative_algorithm')!r}):"
                f" the launch template must not add speculative flags of its own")

    def version(self, info: dict[str, Any]) -> str | None:
        return info.get("version")

    def dtype(self, info: dict[str, Any]) -> str:
        return str(info.get("dtype") or "unknown")

    def speculate(self, url: str, prompts: list[list[int]], max_new_tokens: int,
                  sampler: SamplingParams, seed: int, params: SpecParams, *,
                  concurrency: int, timeout: float) -> EngineRun:
        # params: checked on /server_info by check_drafter (SGLang answers carry no settings)
        run = measure_server_acceptance(url, prompts, max_new_tokens, sampler=sampler,
                                        seed=seed, return_outputs=True,
                                        concurrency=concurrency, timeout=timeout)
        return EngineRun(run.per_prompt, run.outputs or ())

    def decode(self, url: str, prompts: list[list[int]], max_new_tokens: int,
               sampler: SamplingParams, seed: int, *, concurrency: int,
               timeout: float) -> tuple[tuple[int, ...], ...]:
        return tuple(decode_plain(url, prompts, max_new_tokens, sampler=sampler, seed=seed,
                                  concurrency=concurrency, timeout=timeout))

    def top2(self, url: str, ids: list[int], *, timeout: float
             ) -> tuple[tuple[int, float], ...]:
        http = JsonHttp(timeout_s=timeout, connect_timeout_s=min(10.0, timeout))
        try:
            body = http.post_json(url, "/generate", {
                "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "top_logprobs_num": 2})
        finally:
            http.close()
        body = body[0] if isinstance(body, list) and len(body) == 1 else body
        try:  # one entry per output token, each [logprob, token_id, text] best first
            entries = body["meta_info"]["output_top_logprobs"][0]
            return tuple((int(e[1]), float(e[0])) for e in entries[:2])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SpeculativeConfigError(f"{url}/generate returned no output_top_logprobs "
                                         f"for a near-tie check ({str(body)[:80]})") from e


def decode_plain(url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampler: SamplingParams = GREEDY, seed: int | None = 0,
                 concurrency: int = 8, timeout: float = 600.0, retries: int = 3,
                 backoff_s: float = 0.5) -> list[tuple[int, ...]]:
    """The generated ids of each prompt on a server decoding *without* a drafter, at
    ``sampler`` with the seeds :func:`.sglang_mode.measure_server_acceptance` sends. Each
    answer is validated as there, less the speculative counters (an answer that carries
    some is refused: the server drafts). Raises ``ServerAcceptanceError`` naming the
    prompt."""
    prompts = [[int(t) for t in p] for p in prompts]
    http = JsonHttp(timeout_s=timeout, connect_timeout_s=min(10.0, timeout))
    try:
        requests = [sampling_params(sampler, seed, i, max_new_tokens, False)
                    for i in range(len(prompts))]
        answers = decode_all(http, (url.rstrip("/"),), prompts, requests, concurrency,
                             RetryPolicy(max_retries=retries, backoff_s=backoff_s),
                             CallStats(), lambda body: parse_plain(body, max_new_tokens))
    finally:
        http.close()
    return [a.output_ids for _, a in answers]


def parse_plain(body: Any, max_new_tokens: int) -> Answer:
    """One answer of a server without a drafter: every token after the first is a forward."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise TransientFailure(f"malformed answer: no meta_info object ({str(body)[:80]})")
    if "spec_verify_ct" in meta:
        raise SpeculativeConfigError("a server meant to decode without a drafter reports "
                                     "spec_verify_ct: it drafts")
    completion = meta.get("completion_tokens")
    forwards = completion - 1 if json_int(completion) else None  # judged by the parser
    return parse_spec_response({**body, "meta_info": {**meta, "spec_verify_ct": forwards}},
                               max_new_tokens=max_new_tokens, num_steps=0)


def _algorithm_of(drafter: Path) -> DrafterAlgorithm:
    try:
        return algorithm_of_directory(drafter)
    except UnknownAlgorithmError as e:
        raise SpeculativeConfigError(f"the drafter to serve: {e}") from e
