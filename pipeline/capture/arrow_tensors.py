"""Arrow arrays over tensor memory and tensors over Arrow buffers, without copies: how
shard rows go into Parquet and come back out (:mod:`pipeline.capture.shards`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

__all__ = ["binary_array", "binary_views", "list_array", "list_views"]


def list_array(x: torch.Tensor, value_type: pa.DataType) -> pa.Array:
    """A one-row list array of the tensor's values."""
    values = pa.array(x.detach().cpu().contiguous().numpy(), value_type)
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values)


def binary_array(x: torch.Tensor) -> pa.Array:
    """A one-value large_binary array over the tensor's bytes (zero-copy when contiguous)."""
    raw = x.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
    offsets = np.array([0, raw.nbytes], dtype=np.int64)
    return pa.Array.from_buffers(pa.large_binary(), 1,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(raw)])


def _buffer_view(buf: pa.Buffer | None, dtype: torch.dtype, start: int, count: int
                 ) -> torch.Tensor:
    """``count`` elements of ``buf`` from element ``start``: a tensor sharing its memory."""
    if count == 0 or buf is None:
        return torch.empty(0, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=start * itemsize)


def list_views(arr: pa.Array, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
    """Row offsets (relative to the returned values) and the flat values of a list array."""
    offsets = arr.offsets.to_numpy()  # honours arr.offset; zero-copy
    child = arr.values  # the unsliced child array
    base = int(offsets[0])
    values = _buffer_view(child.buffers()[1], dtype, child.offset + base,
                          int(offsets[-1]) - base)
    return offsets - base, values


def binary_views(arr: pa.Array) -> tuple[np.ndarray, torch.Tensor]:
    """Byte offsets (relative to the returned bytes) and the bytes of a large_binary array."""
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64, count=len(arr) + 1, offset=arr.offset * 8)
    base = int(offsets[0])
    data = _buffer_view(data_buf, torch.uint8, base, int(offsets[-1]) - base)
    return offsets - base, data
