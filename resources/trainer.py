"""The trainer resource: where and how drafter training runs (processes, precision, device).

Hyper-parameters live in the ``drafter_checkpoint`` run config; this resource owns the
execution fields of :class:`~pipeline.training.config.TrainConfig` (``world_size``,
``zero_stage``, ``dtype``, ``device``, ``threads``) plus the launcher and the work directory
where resumable runs live.
"""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dagster import ConfigurableResource
from pydantic import Field

from pipeline.storage import Storage
from pipeline.training.config import Device, Dtype, LauncherKind, TrainConfig
from resources.env import resource_from_env
from resources.home import aerie_home

if TYPE_CHECKING:  # torch and the training stage load when a drafter is trained
    from pipeline.training.curve import TrainingObserver
    from pipeline.training.launch import Launcher
    from pipeline.training.stage import DrafterRefresh

EXECUTION_FIELDS = ("world_size", "zero_stage", "dtype", "device", "threads")


class TrainerResource(ConfigurableResource):
    """Builds and runs the core trainer (:func:`pipeline.training.stage.run`)."""

    world_size: int = Field(default=1, ge=1, description="training processes (ranks): on "
                                                         "this host, or the hostfile's "
                                                         "slots")
    launcher: LauncherKind = Field(
        default="auto", description="auto: python for 1 rank, else torchrun")
    zero_stage: int = Field(default=2, ge=0, le=2, description="DeepSpeed ZeRO stage: 0, 1 "
                                                               "or 2")
    dtype: Literal[Dtype, "auto"] = Field(
        default="auto", description="auto: bf16 on CUDA, else fp32 (bf16 needs ZeRO 1 or 2)")
    device: Literal[Device, "auto"] = Field(
        default="auto", description="auto: cuda when available")
    threads: int = Field(default=0, ge=0, description="torch threads per rank; 0 = torch "
                                                      "default")
    hostfile: str | None = Field(
        default=None, description="deepspeed: ranks on several hosts, a DeepSpeed hostfile "
                                  "('host slots=N' lines adding up to world_size); needs ssh "
                                  "+ pdsh between the hosts and work_dir on a shared "
                                  "filesystem (docs/deploy.md)")
    master_addr: str | None = Field(
        default=None, description="with a hostfile of several hosts: the address of its "
                                  "first host (rank 0) as the others reach it; unset: "
                                  "DeepSpeed resolves it")
    work_dir: str | None = Field(default=None, description="resumable runs (checkpoints, "
                                                           "logs); unset: $AERIE_HOME/training")

    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` with this resource's execution fields."""
        device = self.resolved_device()
        dtype = self.dtype if self.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
        return replace(config, world_size=self.world_size, zero_stage=self.zero_stage,
                       dtype=dtype, device=device, threads=self.threads)

    def launch_with(self) -> "str | Launcher":
        """The launcher: its name, or with a hostfile the :class:`Launcher` over the hosts."""
        if not self.hostfile:
            return self.launcher
        from pipeline.training.launch import Launcher

        return Launcher("deepspeed" if self.launcher == "auto" else self.launcher,
                        self.hostfile, self.master_addr)

    def work_root(self) -> Path:
        return Path(self.work_dir) if self.work_dir else aerie_home() / "training"

    def refresh(self, storage: Storage, step: int, config: TrainConfig, *,
                warm_start: str = "serving", serving_name: str | None = None,
                on_line: Callable[[str], None] | None = None,
                observer: "TrainingObserver | None" = None) -> "DrafterRefresh":
        """Train, export and publish the drafter of refresh step ``step``."""
        from pipeline.training import stage as training_stage

        return training_stage.run(storage, step, self.apply(config), work_root=self.work_root(),
                               warm_start=warm_start, serving_name=serving_name,
                               launcher=self.launch_with(),
                               storage_options=storage.storage_options,
                               on_line=on_line, observer=observer)


def trainer_from_env() -> TrainerResource:
    """Every field from ``AERIE_TRAINER_<FIELD>`` where it is set."""
    return resource_from_env(TrainerResource, "AERIE_TRAINER_")
