"""Entry point of a training process: ``python -m pipeline.training.worker --spec spec.json``.

Started by :mod:`pipeline.training.launch` directly (1 process) or under torchrun / the
DeepSpeed launcher (N processes, each with ``RANK``/``WORLD_SIZE`` set). Storage options
(credentials) arrive as JSON in the ``AERIE_TRAIN_STORAGE_OPTIONS`` environment variable set
by the parent for this child only, so they are never written to the spec file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pipeline.records import from_json

STORAGE_OPTIONS_ENV = "AERIE_TRAIN_STORAGE_OPTIONS"
# the parent's dataset cache: plain values, so that DeepSpeed can hand them to ranks on other
# hosts (it quotes an exported value whole, which would break JSON)
CACHE_DIR_ENV, CACHE_MAX_BYTES_ENV = "AERIE_TRAIN_CACHE_DIR", "AERIE_TRAIN_CACHE_MAX_BYTES"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="path of the TrainSpec JSON")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="passed by the DeepSpeed launcher; LOCAL_RANK is used instead")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    # DeepSpeed's autotuner imports mlflow eagerly when it is installed (~2 s per process);
    # training never uses it, so the import is blocked in this process only.
    sys.modules.setdefault("mlflow", None)
    from pipeline.storage import Storage
    from pipeline.training.distributed import shutdown
    from pipeline.training.loop import train
    from pipeline.training.spec import TrainSpec

    spec = from_json(TrainSpec, Path(args.spec).read_text())
    options = json.loads(os.environ.get(STORAGE_OPTIONS_ENV) or "{}")
    max_bytes = os.environ.get(CACHE_MAX_BYTES_ENV)
    try:
        train(spec, Storage(spec.storage_url, options,
                            cache_dir=os.environ.get(CACHE_DIR_ENV) or None,
                            cache_max_bytes=int(max_bytes) if max_bytes else None))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
