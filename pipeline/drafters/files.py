"""A drafter export on disk: ``config.json`` and ``model.safetensors``, written atomically.

Every algorithm's export is this directory; what differs is which tensors and keys it holds
(the algorithm's ``save``). Both files are written into a temporary sibling directory that
is renamed into place, so a reader never sees a half-written export; an existing directory
is replaced only with ``overwrite=True`` (the old one moved aside first, then removed).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float32: "float32"}


def check_dtype(dtype: torch.dtype) -> str:
    """The ``torch_dtype`` name of an export dtype, or a ValueError naming the choices."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype}")
    return DTYPE_NAMES[dtype]


def write_export(directory: str | Path, tensors: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any], *, overwrite: bool = False) -> Path:
    """``tensors`` (CPU, contiguous) and ``config`` written as the export ``directory``."""
    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists (pass overwrite=True to replace it)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(dict(tensors), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _publish(tmp: Path, directory: Path) -> None:
    """Rename ``tmp`` to ``directory``, replacing an existing one (old moved aside first)."""
    if not directory.exists():
        os.replace(tmp, directory)
        return
    old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
