"""The capture resource: which backend produces hidden states (``hf``, ``sglang`` or
``vllm``)."""

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dagster import ConfigurableResource, Failure, InitResourceContext
from pydantic import Field

from pipeline.storage import Storage

if TYPE_CHECKING:  # the capture backends import torch: loaded when a backend is opened
    from pipeline.capture.base import CaptureBackend


class CaptureResource(ConfigurableResource):
    """Builds the capture backend for one RL step's policy checkpoint."""

    backend: str = Field(default="hf", description="'hf': the step's policy checkpoint "
                                                   "in-process; 'sglang' or 'vllm': running "
                                                   "servers")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="decoder layers whose outputs are captured, low→mid→high; "
                                  "unset: EAGLE-3's [1, N//2-1, N-4]")
    hf_dtype: str = Field(default="float32", description="hf: compute dtype "
                                                         "(float32 | bfloat16)")
    hf_device: str = Field(default="cpu", description="hf: where the policy runs: cpu, "
                                                      "cuda, cuda:N, or auto (CUDA when "
                                                      "present)")
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
                                             "(README, Capturing with vLLM)")
    vllm_files_dir: str | None = Field(default=None,
                                       description="vllm: where this process reads the files "
                                                   "the servers write")
    vllm_server_files_dir: str | None = Field(default=None,
                                              description="vllm: the same directory as the "
                                                          "servers see it; unset: "
                                                          "vllm_files_dir")

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Refuse a misconfigured backend before any step runs (no retries), naming the
        fields to set."""
        problem = self.problem()
        if problem:
            raise Failure(description=problem, allow_retries=False)

    def problem(self) -> str | None:
        """What is wrong with the configuration, with the fix; None when nothing is."""
        where = "resources.capture.config"
        if self.backend not in ("hf", "sglang", "vllm"):
            return (f"capture backend {self.backend!r} is unknown: set {where}.backend to "
                    f"'hf', 'sglang' or 'vllm'")
        if self.backend == "hf":
            if not re.fullmatch(r"cpu|auto|cuda(:[0-9]+)?", self.hf_device):
                return (f"{where}.hf_device {self.hf_device!r} is not a device: set it to "
                        f"'cpu', 'cuda', 'cuda:N' or 'auto'")
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
                    f"the README, Capturing hidden states with SGLang")
        if bad:
            return (f"{where}: sglang_aux_urls and sglang_final_urls must be http(s) URLs, "
                    f"got {bad}")
        return None

    def _vllm_problem(self, where: str) -> str | None:
        if not self.vllm_urls or not self.vllm_files_dir:
            return (f"capture backend 'vllm' needs {where}.vllm_urls (servers launched with "
                    f"the extract_hidden_states method) and {where}.vllm_files_dir (where "
                    f"their files are read); see the README, Capturing hidden states with vLLM")
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
        return {"kind": self.backend, "aux_layer_ids": self.aux_layer_ids,
                "token_budget": token_budget, "hf_dtype": self.hf_dtype,
                "hf_device": self.hf_device, "sglang_aux_urls": list(self.sglang_aux_urls),
                "sglang_final_urls": list(self.sglang_final_urls),
                "vllm_urls": list(self.vllm_urls), "vllm_files_dir": self.vllm_files_dir,
                "vllm_server_files_dir": self.vllm_server_files_dir}

    @contextlib.contextmanager
    def open(self, storage: Storage, step: int, token_budget: int
             ) -> Iterator["CaptureBackend"]:
        from pipeline.capture.backends import open_backend

        with open_backend(storage, step, **self.open_args(token_budget)) as backend:
            yield backend
