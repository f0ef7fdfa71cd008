"""The capture resource: which backend produces hidden states, and a typed section of
settings per backend (``hf``, ``sglang``, ``vllm``; the engines' client settings in
``engine``). The choices are the capture backends' registry
(:data:`pipeline.capture.backends.BACKENDS`)."""

import contextlib
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal

from dagster import Config, ConfigurableResource, Failure, InitResourceContext
from pydantic import Field

from pipeline.algorithms import UnknownAlgorithmError, algorithm
from pipeline.capture.backends import (
    BACKENDS,
    CaptureDtype,
    EngineClient,
    HFOptions,
    SGLangOptions,
    VLLMOptions,
)
from pipeline.storage import Storage
from resources.env import resource_from_env
from resources.run_config import ALGORITHM_VAR

if TYPE_CHECKING:  # the capture backends import torch: loaded when a backend is opened
    from pipeline.capture.base import CaptureBackend

WHERE = "resources.capture.config"
_ENV = {"drafter_algorithm": ALGORITHM_VAR}  # the variable the refresh job's training reads


# each section's defaults are its backend's settings' (pipeline.capture.backends): one copy

class HFCapture(Config):
    """``hf``: the step's policy checkpoint in-process."""

    dtype: CaptureDtype = Field(
        default=HFOptions.dtype, description="compute dtype (bfloat16 on GPUs)")
    device: str = Field(default=HFOptions.device, pattern=r"^(cpu|auto|cuda(:[0-9]+)?)$",
                        description="where the policy runs: cpu, cuda, cuda:N, or auto "
                                    "(CUDA when present)")
    processes: int = Field(default=1, ge=1, description="processes that extract a step "
                                                        "together (shard i in process i mod "
                                                        "N): one per GPU, or CPU workers "
                                                        "sharing the cores")

    def options(self) -> HFOptions:
        return HFOptions(dtype=self.dtype, device=self.device)


class EngineClientConfig(Config):
    """How the ``sglang`` and ``vllm`` backends talk to their servers."""

    api_key: str | None = Field(
        default=None, description="the servers' --api-key, sent as a bearer token; set it "
                                  "only through AERIE_CAPTURE_ENGINE_API_KEY (an EnvVar, "
                                  "never run config)")
    timeout_s: float = Field(default=EngineClient.timeout_s, gt=0,
                             description="seconds per request")
    connect_timeout_s: float = Field(default=EngineClient.connect_timeout_s, gt=0,
                                     description="seconds to connect")
    max_concurrency: int = Field(default=EngineClient.max_concurrency, ge=1,
                                 description="requests in flight at once, over all servers")
    max_retries: int = Field(default=EngineClient.max_retries, ge=0,
                             description="retries of a request that failed transiently")

    def client(self) -> EngineClient:
        return EngineClient(timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                            max_concurrency=self.max_concurrency, max_retries=self.max_retries,
                            api_key=self.api_key)


class SGLangCapture(Config):
    """``sglang``: running servers (docs/sglang.md)."""

    aux_urls: list[str] = Field(default_factory=list,
                                description="aux-capture server URLs "
                                            "(--enable-return-aux-hidden-states)")
    final_urls: list[str] = Field(default_factory=list,
                                  description="final-state server URLs "
                                              "(--enable-return-hidden-states)")

    def problem(self) -> str | None:
        missing = [f"sglang.{name}" for name in ("aux_urls", "final_urls")
                   if not getattr(self, name)]
        if missing:
            return (f"capture backend 'sglang' needs {' and '.join(missing)}: set {WHERE}."
                    f"sglang.aux_urls to the aux-capture servers (--enable-return-aux-hidden-"
                    f"states) and {WHERE}.sglang.final_urls to the final-state servers "
                    f"(--enable-return-hidden-states), e.g. [\"http://127.0.0.1:30001\"]; see "
                    f"docs/sglang.md")
        bad = [u for u in self.aux_urls + self.final_urls if not _is_http(u)]
        if bad:
            return f"{WHERE}.sglang: aux_urls and final_urls must be http(s) URLs, got {bad}"
        return None

    def options(self, engine: EngineClientConfig) -> SGLangOptions:
        return SGLangOptions(aux_urls=tuple(self.aux_urls), final_urls=tuple(self.final_urls),
                             client=engine.client())


class VLLMCapture(Config):
    """``vllm``: servers launched with the extract_hidden_states method (docs/vllm.md)."""

    urls: list[str] = Field(default_factory=list, description="the servers' URLs")
    files_dir: str | None = Field(default=None, description="where this process reads the "
                                                            "files the servers write")
    server_files_dir: str | None = Field(default=None, description="the same directory as "
                                                                   "the servers see it; "
                                                                   "unset: files_dir")
    file_timeout_s: float = Field(default=VLLMOptions.file_timeout_s, gt=0,
                                  description="seconds for a hidden-states file to appear "
                                              "after the answer")

    def problem(self) -> str | None:
        if not self.urls or not self.files_dir:
            return (f"capture backend 'vllm' needs {WHERE}.vllm.urls (servers launched with "
                    f"the extract_hidden_states method) and {WHERE}.vllm.files_dir (where "
                    f"their files are read); see docs/vllm.md")
        bad = [u for u in self.urls if not _is_http(u)]
        if bad:
            return f"{WHERE}.vllm.urls must be http(s) URLs, got {bad}"
        return None

    def options(self, engine: EngineClientConfig) -> VLLMOptions:
        return VLLMOptions(urls=tuple(self.urls), files_dir=self.files_dir,
                           server_files_dir=self.server_files_dir,
                           file_timeout_s=self.file_timeout_s, client=engine.client())


def _is_http(url: str) -> bool:
    return url.strip().startswith(("http://", "https://"))


class CaptureResource(ConfigurableResource):
    """Builds the capture backend for one RL step's policy checkpoint."""

    backend: Literal[tuple(BACKENDS)] = Field(  # type: ignore[valid-type]
        default="hf", description="'hf': the step's policy checkpoint in-process; 'sglang' "
                                  "or 'vllm': running servers")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="decoder layers whose outputs are captured, low→mid→high; "
                                  "unset: EAGLE-3's [1, N//2-1, N-4]")
    drafter_algorithm: str | None = Field(
        default=None, description="with aux_layer_ids unset: the drafter algorithm whose "
                                  "default layers are captured (DFlash's "
                                  "round(1 + i (N-4)/(L-1)); unset: EAGLE-3's); "
                                  "AERIE_DRAFTER_ALGORITHM, which the refresh job trains")
    hf: HFCapture = Field(default_factory=HFCapture, description="the hf backend")
    sglang: SGLangCapture = Field(default_factory=SGLangCapture,
                                  description="the sglang backend")
    vllm: VLLMCapture = Field(default_factory=VLLMCapture, description="the vllm backend")
    engine: EngineClientConfig = Field(default_factory=EngineClientConfig,
                                       description="the sglang and vllm backends' clients")

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Refuse a misconfigured backend before any step runs (no retries), naming the
        fields to set."""
        problem = self.problem()
        if problem:
            raise Failure(description=problem, allow_retries=False)

    def problem(self) -> str | None:
        """What is wrong with the configuration, with the fix; None when nothing is."""
        if self.drafter_algorithm is not None:
            try:
                algorithm(self.drafter_algorithm)
            except UnknownAlgorithmError as e:
                return f"{WHERE}.drafter_algorithm: {e}"
        if self.backend == "hf":
            return None
        if self.hf.processes > 1:
            return (f"{WHERE}.hf.processes is {self.hf.processes}, but only the 'hf' backend "
                    f"runs in processes: an engine's parallelism is its servers (list more "
                    f"URLs)")
        return getattr(self, self.backend).problem()

    @property
    def processes(self) -> int:
        return self.hf.processes if self.backend == "hf" else 1

    def options(self) -> Any:
        """The chosen backend's settings (:data:`~pipeline.capture.backends.BACKENDS`)."""
        section = getattr(self, self.backend)
        return section.options() if self.backend == "hf" else section.options(self.engine)

    def open_args(self, token_budget: int) -> dict[str, Any]:
        """``open_backend``'s keyword arguments (JSON: a data-parallel extraction hands
        them to its other processes)."""
        return {"kind": self.backend, "aux_layer_ids": self.aux_layer_ids,
                "layers_for": self.drafter_algorithm, "token_budget": token_budget,
                "options": asdict(self.options())}

    @contextlib.contextmanager
    def open(self, storage: Storage, step: int, token_budget: int
             ) -> Iterator["CaptureBackend"]:
        from pipeline.capture.backends import open_backend

        with open_backend(storage, step, **self.open_args(token_budget)) as backend:
            yield backend


def capture_from_env() -> CaptureResource:
    """Every field from ``AERIE_CAPTURE_<FIELD>`` where it is set, a section's fields from
    ``AERIE_CAPTURE_<SECTION>_<FIELD>`` (``AERIE_CAPTURE_HF_DTYPE``; lists as JSON or
    comma-separated); the API key as an ``EnvVar``."""
    return resource_from_env(CaptureResource, "AERIE_CAPTURE_", secrets=("engine.api_key",),
                             names=_ENV)
