"""The fused attention kernels Aerie's own forward passes may run.

Recent PyTorch builds try cuDNN's fused attention first on Hopper and Blackwell GPUs
(``check_prefer_cudnn_attention`` in ATen's ``sdp_utils.cpp``). cuDNN builds and caches an
execution graph for each new problem shape, at a cost of milliseconds to tens of
milliseconds of host time per build. Aerie's passes run a new shape on almost every call:

- the TTT chain attends in per-sequence query chunks against key prefixes of every length;
- the evaluation engine verifies a draft tree against a cache that grows every cycle;
- the cache-free reference grows by one token per pass;
- each capture batch is as long as its longest sample.

On an H200 a training step of the GPU check's small world took 7 to 18 s
(``bench/gpu_check.py``, see the benchmarks page). Those graph builds are the likely cause.
A GPU run with this module has not yet confirmed it.

:func:`shape_stable` runs a block with the flash, memory-efficient or math kernels only.
Each computes the same exact softmax attention, and none of them builds anything per shape.
On a CPU it changes nothing, because cuDNN attention exists only on CUDA.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE_STABLE = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def shape_stable() -> AbstractContextManager[None]:
    """Attention in the block runs without cuDNN's per-shape graphs (see the module
    docstring). The backends enabled before are restored on exit."""
    return sdpa_kernel(list(SHAPE_STABLE))
