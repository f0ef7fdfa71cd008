"""The fused attention kernels Aerie's own forward passes may run.

Recent PyTorch builds try cuDNN's fused attention first on Hopper and Blackwell GPUs
(``check_prefer_cudnn_attention`` in ATen's ``sdp_utils.cpp``). cuDNN builds and caches an
execution graph for each new problem shape, at a cost of milliseconds to tens of
milliseconds of host time per build. Aerie's passes run a new shape on almost every call:

- the TTT chain attends in per-sequence query chunks against key prefixes of every length;
- the evaluation engine verifies a draft tree against a cache that grows every cycle;
- the cache-free reference grows by one token per pass;
- each capture batch is as long as its longest sample.

On an H200 the GPU check's training steps took 7 to 16 s at H = 512 and 12 to 18 s at
Llama-3-8B's width (``bench/gpu_check.py``, see the benchmarks page). Those graph builds are
the likely cause. A GPU run with this module has not yet confirmed it.

:func:`shape_stable` turns cuDNN attention off for a block. PyTorch then picks among the
flash, memory-efficient and math kernels the user left enabled. Each of them computes the
same exact softmax attention, and none builds anything per shape. On a CPU it changes
nothing, because cuDNN attention exists only on CUDA.

The switch is one process-wide flag, so the blocks are counted. The first block to enter
saves the flag and turns cuDNN off, and the last one to leave restores the saved value.
Blocks may nest and may run on several threads at once (a server decoding requests side by
side). While any block runs, no attention in the process uses cuDNN.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_lock = threading.Lock()
_open = 0  # blocks inside shape_stable() now, over all threads
_saved = True  # cuDNN attention's flag before the first of them


@contextlib.contextmanager
def shape_stable() -> Iterator[None]:
    """Attention in the block runs without cuDNN's per-shape graphs (see the module
    docstring)."""
    global _open, _saved
    with _lock:
        if _open == 0:
            _saved = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                torch.backends.cuda.enable_cudnn_sdp(_saved)
