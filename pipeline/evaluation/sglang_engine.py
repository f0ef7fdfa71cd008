"""SGLang as the engine evaluator's judge (:mod:`.on_engine`): its launch flags, what its
``/server_info`` must say, and its counters (:mod:`.sglang_mode`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import requests

from pipeline.eagle3.spec import SpecParams
from pipeline.evaluation.engine_api import EngineRun
from pipeline.evaluation.sglang_mode import (
    SpeculativeConfigError,
    decode_plain,
    measure_server_acceptance,
)
from pipeline.sampling import SamplingParams


class SGLang:
    """The ``sglang`` evaluator's engine."""

    name = "sglang"
    # server_info keys the report keeps: what decides the numbers, never a secret
    recorded_args = ("model_path", "tp_size", "dp_size", "ep_size", "pp_size", "dtype",
                     "kv_cache_dtype", "attention_backend", "sampling_backend", "random_seed",
                     "enable_deterministic_inference", "disable_radix_cache")

    def speculative_args(self, drafter: Path, params: SpecParams) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", str(drafter),
                "--speculative-num-steps", str(params.num_steps),
                "--speculative-eagle-topk", str(params.eagle_topk),
                "--speculative-num-draft-tokens", str(params.num_draft_tokens)]

    def server_info(self, url: str) -> dict[str, Any]:
        r = requests.get(url + "/server_info", timeout=30)
        if r.status_code == 404:
            r = requests.get(url + "/get_server_info", timeout=30)
        r.raise_for_status()
        info = r.json()
        if not isinstance(info, dict):
            raise SpeculativeConfigError(f"{url}/server_info is not an object")
        return info

    def check_drafter(self, label: str, info: dict[str, Any], drafter: Path,
                      params: SpecParams) -> None:
        algorithm = info.get("speculative_algorithm")
        path = info.get("speculative_draft_model_path")
        if str(algorithm).upper() != "EAGLE3" or not path:
            raise SpeculativeConfigError(
                f"{label} came up without speculative decoding (server_info: "
                f"speculative_algorithm={algorithm!r}, speculative_draft_model_path={path!r}); "
                f"the launch template must pass {{speculative_args}} to SGLang")
        if str(path) != str(drafter) and Path(str(path)).name != drafter.name:
            raise SpeculativeConfigError(f"{label} loaded the drafter {path}, not the one it "
                                         f"was given ({drafter})")
        reported = (info.get("speculative_num_steps"), info.get("speculative_eagle_topk"),
                    info.get("speculative_num_draft_tokens"))
        if reported != (params.num_steps, params.eagle_topk, params.num_draft_tokens):
            raise SpeculativeConfigError(f"{label} runs speculative settings {reported}, not "
                                         f"the {tuple(asdict(params).values())} asked for")

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
        run = measure_server_acceptance(url, prompts, max_new_tokens, sampler=sampler,
                                        seed=seed, return_outputs=True,
                                        concurrency=concurrency, timeout=timeout)
        if run.spec_params != params:
            raise SpeculativeConfigError(f"{url} drafted with {run.spec_params}, not {params}")
        return EngineRun(run.per_prompt, run.outputs or ())

    def decode(self, url: str, prompts: list[list[int]], max_new_tokens: int,
               sampler: SamplingParams, seed: int, *, concurrency: int,
               timeout: float) -> tuple[tuple[int, ...], ...]:
        return tuple(decode_plain(url, prompts, max_new_tokens, sampler=sampler, seed=seed,
                                  concurrency=concurrency, timeout=timeout))

    def top2(self, url: str, ids: list[int], *, timeout: float
             ) -> tuple[tuple[int, float], ...]:
        r = requests.post(url + "/generate", timeout=timeout, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2})
        r.raise_for_status()
        body = r.json()
        body = body[0] if isinstance(body, list) and len(body) == 1 else body
        try:  # one entry per output token, each [logprob, token_id, text] best first
            entries = body["meta_info"]["output_top_logprobs"][0]
            return tuple((int(e[1]), float(e[0])) for e in entries[:2])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SpeculativeConfigError(f"{url}/generate returned no output_top_logprobs "
                                         f"for a near-tie check ({str(body)[:80]})") from e
