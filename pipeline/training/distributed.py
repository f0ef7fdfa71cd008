"""Process-group setup for a training process: one process without a launcher, or N under one.

Invariants:

- Under torchrun / the DeepSpeed launcher the launcher's ``RANK``/``WORLD_SIZE``/… are used
  as given. Without them (plain ``python -m pipeline.training.worker``) a one-process group is
  made on 127.0.0.1 with a free port.
- CPU runs use gloo and ``DS_ACCELERATOR=cpu`` (set before DeepSpeed is imported, which is
  when it picks its accelerator); CUDA runs use NCCL and the local rank's GPU.
- CPU runs reduce through gloo only: DeepSpeed's shared-memory all-reduce op is marked
  unavailable, as it is C++ compiled on first use (about a minute on 2 cores, again for every
  fresh cache: each CI machine, each user's first ``aerie demo``), for the one-process runs that
  reduce nothing and the small multi-process runs of tests and demos.
- The world size found must equal the configured one: a silent 1-of-2 run would train on half
  the data with the wrong schedule.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU all-reduce op (ShareMemCommBuilder.NAME)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: str, world_size: int) -> DistContext:
    """Initialise ``torch.distributed`` through DeepSpeed for ``device`` ("cpu" | "cuda")."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                           "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port()))})
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    elif not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but CUDA is not available")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if size != world_size:
        raise RuntimeError(f"the launcher started {size} processes, the config expects "
                           f"{world_size}")
    import deepspeed

    if device == "cpu":  # DeepSpeed reads this dict when it sets up its comm backend
        deepspeed.ops.__compatible_ops__[SHM_OP] = False
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl",
                               auto_mpi_discovery=False)
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    return DistContext(rank=rank, world_size=size, local_rank=local, device=dev)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
