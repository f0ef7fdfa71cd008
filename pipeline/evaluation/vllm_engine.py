"""vLLM as the engine evaluator's judge (:mod:`.on_engine`), over its OpenAI-compatible
server (vLLM 0.33, sources in docs/vllm.md):

- launch flags for a drafter: ``--speculative-config`` (EAGLE-3 as a chain of
  ``num_speculative_tokens``: ``eagle_topk`` must be 1) and
  ``--per-request-spec-decode-metrics summary``, which makes each completion carry
  ``metrics.speculative_decoding`` (top level of the response; only for one prompt with
  ``n`` 1);
- each prompt is one ``POST /v1/completions`` with the token ids as ``prompt``,
  ``return_token_ids`` true (the ids come back in ``choices[0].token_ids``), the sampler's
  fields set explicitly (unset ones would take the model's ``generation_config``) and
  ``seed`` = the in-process engine's per-prompt seed;
- τ per prompt: the tokens after the prefill's (``len(token_ids) - 1``, as emitted) over
  ``num_spec_steps`` (verify passes that carried draft tokens; vLLM counts the accepted
  drafts of the last pass before trimming at a stop, so its own ``mean_acceptance_length``
  can exceed what was emitted);
- the server says of itself only ``GET /version`` and ``GET /v1/models``; with
  ``VLLM_SERVER_DEV_MODE=1`` also ``GET /server_info?config_format=json``, whose
  ``speculative_config`` names the drafter, checked with its method and
  ``num_speculative_tokens``. Without it, every answer's ``num_spec_tokens`` must be the
  ``num_steps`` asked for, and a server that serves another drafter can only be caught by its
  acceptance (:class:`.on_engine.DrafterNotDrafting`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.algorithms import UnknownAlgorithmError, algorithm_of_directory
from pipeline.capture.engine_http import (
    CallStats,
    EngineRequestError,
    JsonHttp,
    RetryPolicy,
    TransientFailure,
    json_int,
    post_each,
)
from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine_api import EngineRun
from pipeline.evaluation.sglang_mode import ServerAcceptanceError, SpeculativeConfigError
from pipeline.sampling import SamplingParams, prompt_seed


class VLLM:
    """The ``vllm`` evaluator's engine."""

    name = "vllm"
    recorded_args = ("model", "max_model_len")

    def __init__(self) -> None:
        self._models: dict[str, str] = {}  # url -> the served model's id

    def speculative_args(self, drafter: Path, params: SpecParams) -> list[str]:
        try:
            config = algorithm_of_directory(drafter).vllm_speculative_config(params, str(drafter))
        except ValueError as e:  # an UnknownAlgorithmError too
            raise SpeculativeConfigError(f"the vllm evaluator: {e}") from e
        return ["--speculative-config", config, "--per-request-spec-decode-metrics", "summary"]

    def server_info(self, url: str) -> dict[str, Any]:
        http = JsonHttp(timeout_s=30.0, connect_timeout_s=10.0)
        try:
            version = http.get_json(url, "/version") or {}
            models = (http.get_json(url, "/v1/models") or {}).get("data") or []
            dev = http.get_json(url, "/server_info?config_format=json")
        finally:
            http.close()
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise SpeculativeConfigError(f"{url}/v1/models lists no model")
        info: dict[str, Any] = {"version": version.get("version"), "model": models[0]["id"],
                                "max_model_len": models[0].get("max_model_len")}
        spec = _dev_speculative_config(dev)
        if spec is not None:
            info["speculative_config"] = spec
        return info

    def check_drafter(self, label: str, info: dict[str, Any], drafter: Path,
                      params: SpecParams) -> None:
        spec = info.get("speculative_config")
        if spec is None:
            return  # not exposed without dev mode: the answers are checked instead
        model = spec.get("model") if isinstance(spec, dict) else None
        if not model:
            raise SpeculativeConfigError(f"{label} came up without speculative decoding "
                                         f"(server_info: speculative_config={spec!r})")
        if str(model) != str(drafter) and Path(str(model)).name != drafter.name:
            raise SpeculativeConfigError(f"{label} loaded the drafter {model}, not the one it "
                                         f"was given ({drafter})")
        try:
            algorithm = algorithm_of_directory(drafter)
        except UnknownAlgorithmError as e:
            raise SpeculativeConfigError(f"the drafter {label} was given: {e}") from e
        asked = json.loads(algorithm.vllm_speculative_config(params, str(drafter)))
        served = (spec.get("method"), spec.get("num_speculative_tokens"))
        wanted = (asked["method"], asked["num_speculative_tokens"])
        if served != wanted:
            raise SpeculativeConfigError(f"{label} runs method/num_speculative_tokens "
                                         f"{served}, not {wanted}")

    def check_plain(self, label: str, info: dict[str, Any]) -> None:
        spec = info.get("speculative_config")
        if isinstance(spec, dict) and spec.get("model"):
            raise SpeculativeConfigError(f"{label} drafts (speculative_config model "
                                         f"{spec['model']}): the launch template must not add "
                                         f"speculative flags of its own")

    def version(self, info: dict[str, Any]) -> str | None:
        return info.get("version")

    def dtype(self, info: dict[str, Any]) -> str:
        return "unknown"  # not said over HTTP

    def speculate(self, url: str, prompts: list[list[int]], max_new_tokens: int,
                  sampler: SamplingParams, seed: int, params: SpecParams, *,
                  concurrency: int, timeout: float) -> EngineRun:
        answers = self._complete(url, prompts, max_new_tokens, sampler, seed, concurrency,
                                 timeout, speculative=params.num_steps)
        return EngineRun(tuple((len(ids) - 1, passes) for ids, passes in answers),
                         tuple(ids for ids, _ in answers))

    def decode(self, url: str, prompts: list[list[int]], max_new_tokens: int,
               sampler: SamplingParams, seed: int, *, concurrency: int,
               timeout: float) -> tuple[tuple[int, ...], ...]:
        answers = self._complete(url, prompts, max_new_tokens, sampler, seed, concurrency,
                                 timeout, speculative=None)
        return tuple(ids for ids, _ in answers)

    def top2(self, url: str, ids: list[int], *, timeout: float
             ) -> tuple[tuple[int, float], ...]:
        http = JsonHttp(timeout_s=timeout, connect_timeout_s=min(10.0, timeout))
        try:
            model = self._model(url)
            body = http.post_json(url, "/v1/completions", {
                "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "logprobs": 2, "return_tokens_as_token_ids": True})
        finally:
            http.close()
        try:  # one {"token_id:N": logprob} per output token
            top = body["choices"][0]["logprobs"]["top_logprobs"][0]
            ranked = sorted(((int(k.split(":", 1)[1]), float(v)) for k, v in top.items()),
                            key=lambda t: -t[1])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise SpeculativeConfigError(f"{url}/v1/completions returned no top_logprobs "
                                         f"for a near-tie check ({str(body)[:80]})") from e
        return tuple(ranked[:2])

    def _model(self, url: str) -> str:
        if url not in self._models:
            self._models[url] = self.server_info(url)["model"]
        return self._models[url]

    def _complete(self, url: str, prompts: list[list[int]], max_new_tokens: int,
                  sampler: SamplingParams, seed: int, concurrency: int, timeout: float, *,
                  speculative: int | None) -> list[tuple[tuple[int, ...], int]]:
        """(generated ids, verify passes) per prompt, in prompt order; ``speculative``: the
        draft tokens per pass a drafter's server must report (None: no drafter)."""
        http = JsonHttp(timeout_s=timeout, connect_timeout_s=min(10.0, timeout))
        try:
            model = self._model(url)
            payloads = [_request(model, p, max_new_tokens, sampler, prompt_seed(seed, i))
                        for i, p in enumerate(prompts)]
            answers = post_each(
                http, [url], "/v1/completions", payloads,
                lambda body: _parse(body, max_new_tokens, speculative),
                concurrency=concurrency, policy=RetryPolicy(max_retries=3, backoff_s=0.5),
                stats=CallStats(), what="vllm completion")
        except EngineRequestError as e:
            i = e.samples[0] if len(e.samples) else -1
            raise ServerAcceptanceError(f"prompt {i} (server {e.url}): {e}", url=e.url,
                                        prompt=i, attempts=e.attempts) from e
        finally:
            http.close()
        return [answer for _, answer in answers]


def _request(model: str, prompt: list[int], max_new_tokens: int, sampler: SamplingParams,
             seed: int) -> dict[str, Any]:
    """One completion request; every sampler field explicit (vLLM fills unset ones from the
    model's generation_config), greedy as temperature 0."""
    fields = ({"temperature": 0.0} if sampler.greedy else
              {"temperature": sampler.temperature, "top_p": sampler.top_p,
               "top_k": sampler.top_k, "min_p": sampler.min_p, "seed": seed})
    return {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "n": 1,
            "return_token_ids": True, **fields}


def _parse(body: Any, max_new_tokens: int, speculative: int | None
           ) -> tuple[tuple[int, ...], int]:
    """(generated ids, verify passes) of one answer; ``speculative``: the draft tokens per
    pass a drafter's server must report, None for the no-drafter server."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise TransientFailure(f"malformed answer: not one choice ({str(body)[:80]})")
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list) or not all(json_int(t) for t in ids) \
            or not 1 <= len(ids) <= max_new_tokens:
        raise TransientFailure(f"malformed answer: choices[0].token_ids {str(ids)[:60]} is "
                               f"not 1 to {max_new_tokens} token ids (is return_token_ids "
                               f"served?)")
    metrics = body.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if speculative is None:
        if isinstance(spec, dict) and spec.get("num_spec_steps"):
            raise SpeculativeConfigError("a server meant to decode without a drafter reports "
                                         "speculative steps: it drafts")
        return tuple(ids), len(ids) - 1
    if not isinstance(spec, dict):
        raise SpeculativeConfigError(
            "the answer carries no metrics.speculative_decoding: the server came up without "
            "speculative decoding, or without --per-request-spec-decode-metrics (the launch "
            "template must pass {speculative_args} to vllm serve)")
    passes, k = spec.get("num_spec_steps"), spec.get("num_spec_tokens")
    if k != speculative:
        raise SpeculativeConfigError(f"the server drafts num_spec_tokens {k!r} per pass, not "
                                     f"the {speculative} asked for")
    if not json_int(passes) or passes < (1 if len(ids) > 1 else 0):
        raise TransientFailure(f"inconsistent answer: num_spec_steps {passes!r} for "
                               f"{len(ids)} generated tokens")
    if len(ids) - 1 > passes * (k + 1):
        raise TransientFailure(f"inconsistent answer: {len(ids) - 1} tokens from {passes} "
                               f"verify passes of {k} draft tokens each")
    return tuple(ids), passes


def _dev_speculative_config(dev: Any) -> dict[str, Any] | None:
    """``speculative_config`` of a dev-mode ``/server_info?config_format=json`` (None when
    the endpoint is off); ``{}`` when it says the server does not speculate."""
    if not isinstance(dev, dict):
        return None
    config = dev.get("vllm_config", dev)
    if not isinstance(config, dict) or "speculative_config" not in config:
        return None
    spec = config["speculative_config"]
    return spec if isinstance(spec, dict) else {}
