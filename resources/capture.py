"""The capture resource: which backend produces hidden states (``hf``, ``sglang`` or
``vllm``)."""

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from dagster import ConfigurableResource, Failure, InitResourceContext
from pydantic import Field

from pipeline.storage import Storage
from resources.env import resource_from_env

if TYPE_CHECKING:  # the capture backends import torch: loaded when a backend is opened
    from pipeline.capture.base import CaptureBackend


class CaptureResource(ConfigurableResource):
    """Builds the capture backend for one RL step's policy checkpoint."""

    backend: Literal["hf", "sglang", "vllm"] = Field(
        default="hf", description="'hf': the step's policy checkpoint in-process; 'sglang' "
                                  "or 'vllm': running servers")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="decoder layers whose outputs are captured, low→mid→high; "
                                  "unset: EAGLE-3's [1, N//2-1, N-4]")
    hf_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="hf: compute dtype (bfloat16 on GPUs)")
    hf_device: str = Field(default="cpu", pattern=r"^(cpu|auto|cuda(:[0-9]+)?)$",
                           description="hf: where the policy runs: cpu, cuda, cuda:N, or "
                                       "auto (CUDA when present)")
    hf_processes: int = Field(default=1, ge=1, description="hf: processes that extract a "
                                                           "step together (shard i in "
                                                           "process i mod N): one per GPU, "
                                                           "or CPU workers sharing the cores")
    sglang_aux_urls: list[str] = Field(default_factory=list,
                                       description="sglang: aux-capture server URLs")
    sglang_final_urls: list[str] = Field(default_factory=list,
                                         description="sglang: final-state server URLs")
    vllm_urls: list[str] = Field(default_factory=list,
                                 description="vllm: servers launched with extract_hidden_states "
                                             "(docs/vllm.md)")
    vllm_files_dir: str | None = Field(default=None,
                                       description="vllm: where this process reads the files "
                                                   "the servers write")
    vllm_server_files_dir: str | None = Field(default=None,
                                              description="vllm: the same directory as the "
                                                          "servers see it; unset: "
                                                          "vllm_files_dir")

    engine_api_key: str | None = Field(
        default=None, description="sglang/vllm: the servers' --api-key, sent as a bearer "
                                  "token; set it only through AERIE_CAPTURE_ENGINE_API_KEY "
                                  "(an EnvVar, never run config)")
    engine_timeout_s: float = Field(default=600.0, gt=0, description="sglang/vllm: seconds "
                                    "per request")
    engine_connect_timeout_s: float = Field(default=10.0, gt=0, description="sglang/vllm: "
                                            "seconds to connect")
    engine_max_concurrency: int = Field(default=8, ge=1, description="sglang/vllm: requests "
                                        "in flight at once, over all servers")
    engine_max_retries: int = Field(default=3, ge=0, description="sglang/vllm: retries of a "
                                    "request that failed transiently")
    vllm_file_timeout_s: float = Field(default=60.0, gt=0, description="vllm: seconds for "
                                       "a hidden-states file to appear after the answer")

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Refuse a misconfigured backend before any step runs (no retries), naming the
        fields to set."""
        problem = self.problem()
        if problem:
            raise Failure(description=problem, allow_retries=False)

    def problem(self) -> str | None:
        """What is wrong with the configuration, with the fix; None when nothing is."""
        where = "resources.capture.config"
        if self.backend == "hf":
            return None
        if self.hf_processes > 1:
            return (f"{where}.hf_processes is {self.hf_processes}, but only the 'hf' backend "
                    f"runs in processes: an engine's parallelism is its servers (list more "
                    f"URLs)")
        if self.backend == "vllm":
            return self._vllm_problem(where)
        missing = [name for name in ("sglang_aux_urls", "sglang_final_urls")
                   if not getattr(self, name)]
        bad = [u for u in self.sglang_aux_urls + self.sglang_final_urls
               if not u.strip().startswith(("http://", "https://"))]
        if missing:
            return (f"capture backend 'sglang' needs {' and '.join(missing)}: set {where}."
                    f"sglang_aux_urls to the aux-capture servers (--enable-return-aux-"
                    f"hidden-states) and {where}.sglang_final_urls to the final-state servers "
                    f"(--enable-return-hidden-states), e.g. [\"http://127.0.0.1:30001\"]; see "
                    f"docs/sglang.md")
        if bad:
            return (f"{where}: sglang_aux_urls and sglang_final_urls must be http(s) URLs, "
                    f"got {bad}")
        return None

    def _vllm_problem(self, where: str) -> str | None:
        if not self.vllm_urls or not self.vllm_files_dir:
            return (f"capture backend 'vllm' needs {where}.vllm_urls (servers launched with "
                    f"the extract_hidden_states method) and {where}.vllm_files_dir (where "
                    f"their files are read); see docs/vllm.md")
        bad = [u for u in self.vllm_urls if not u.strip().startswith(("http://", "https://"))]
        if bad:
            return f"{where}.vllm_urls must be http(s) URLs, got {bad}"
        return None

    @property
    def processes(self) -> int:
        return self.hf_processes if self.backend == "hf" else 1

    def open_args(self, token_budget: int) -> dict[str, Any]:
        """``open_backend``'s keyword arguments (JSON: a data-parallel extraction hands
        them to its other processes)."""
        args = {"kind": self.backend, "aux_layer_ids": self.aux_layer_ids,
                "token_budget": token_budget, "hf_dtype": self.hf_dtype,
                "hf_device": self.hf_device}
        if self.backend == "hf":
            return args
        client = {"timeout_s": self.engine_timeout_s,
                  "connect_timeout_s": self.engine_connect_timeout_s,
                  "max_concurrency": self.engine_max_concurrency,
                  "max_retries": self.engine_max_retries, "api_key": self.engine_api_key}
        if self.backend == "vllm":
            client["file_timeout_s"] = self.vllm_file_timeout_s
        return {**args, "sglang_aux_urls": list(self.sglang_aux_urls),
                "sglang_final_urls": list(self.sglang_final_urls),
                "vllm_urls": list(self.vllm_urls), "vllm_files_dir": self.vllm_files_dir,
                "vllm_server_files_dir": self.vllm_server_files_dir, "client": client}

    @contextlib.contextmanager
    def open(self, storage: Storage, step: int, token_budget: int
             ) -> Iterator["CaptureBackend"]:
        from pipeline.capture.backends import open_backend

        with open_backend(storage, step, **self.open_args(token_budget)) as backend:
            yield backend


def capture_from_env() -> CaptureResource:
    """Every field from ``AERIE_CAPTURE_<FIELD>`` where it is set (lists as JSON or
    comma-separated); the API key as an ``EnvVar``."""
    return resource_from_env(CaptureResource, "AERIE_CAPTURE_", secrets=("engine_api_key",))
