"""Every path of the storage tree, in one place.

Keys are relative to the storage root (``file://…`` or ``s3://bucket/prefix``); each
dataset is a key prefix holding its files and, written last, ``_manifest.json``::

    policies/step=NNNNNN/     the policy checkpoint that generated step N (HF layout)
    rollouts/step=NNNNNN/     records as the RL trainer wrote them (SnapshotWriter)
    snapshots/step=NNNNNN/    validated records + quarantine        (stage 1, snapshot)
    tokenized/step=NNNNNN/    input ids + loss masks                (stage 2, tokenize)
    shards/step=NNNNNN/       hidden-state shards + _progress/      (stage 3, capture)
    vocab/<cache key>/        a draft-vocab mapping, keyed by its inputs (stage 4, vocab)
    vocab/step=NNNNNN/        which mapping and window refresh step N uses
    drafters/step=NNNNNN/     the drafter trained at refresh step N  (stage 5, training)
    evals/step=NNNNNN/        acceptance report, charts/<name>.png   (stage 6, evaluation)
    serving/<name>/           serving manifests + current.json       (stage 7, release)
    observed/step=NNNNNN/     acceptance the RL engine reported      (serving_acceptance)

Step directories are ``step=`` plus the step as :func:`step_dir` writes it: six ASCII digits,
zero-padded, or more without padding (:func:`parse_step_dir` refuses anything else, so
``step=0003`` and ``step=²`` are never read as steps).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pipeline.contracts import MANIFEST_NAME

POLICIES = "policies"
ROLLOUTS = "rollouts"
SNAPSHOTS = "snapshots"
TOKENIZED = "tokenized"
SHARDS = "shards"
VOCAB = "vocab"
DRAFTERS = "drafters"
EVALS = "evals"
SERVING = "serving"
OBSERVED = "observed"  # acceptance the RL engine reported, per RL step

_STEP_DIR = re.compile(r"step=([0-9]{6}|[1-9][0-9]{6,})")  # what step_dir writes
_SERVING_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def step_dir(step: int) -> str:
    return f"step={step:06d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step=NNNNNN`` directory name, or None for any other name."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def policy_prefix(step: int) -> str:
    return f"{POLICIES}/{step_dir(step)}"


def raw_prefix(step: int) -> str:
    return f"{ROLLOUTS}/{step_dir(step)}"


def snapshot_prefix(step: int) -> str:
    return f"{SNAPSHOTS}/{step_dir(step)}"


def tokenized_prefix(step: int) -> str:
    return f"{TOKENIZED}/{step_dir(step)}"


def shards_prefix(step: int) -> str:
    return f"{SHARDS}/{step_dir(step)}"


def mapping_prefix(cache_key: str) -> str:
    return f"{VOCAB}/{cache_key}"


def vocab_pointer_prefix(step: int) -> str:
    return f"{VOCAB}/{step_dir(step)}"


def drafter_prefix(step: int) -> str:
    return f"{DRAFTERS}/{step_dir(step)}"


def eval_prefix(step: int) -> str:
    return f"{EVALS}/{step_dir(step)}"


def chart_key(step: int, name: str) -> str:
    """A PNG chart of refresh step ``step`` (α per position, τ over steps, training curve):
    stored beside the report, never inside the drafter directory that is served."""
    return f"{eval_prefix(step)}/charts/{name}.png"


def observed_key(step: int) -> str:
    """The acceptance the rollout engine reported for RL step ``step``, per drafter version
    (:mod:`pipeline.monitor.observed`)."""
    return f"{OBSERVED}/{step_dir(step)}/acceptance.json"


def serving_prefix(name: str) -> str:
    if not _SERVING_NAME.fullmatch(name):
        raise ValueError(f"serving name {name!r} must match {_SERVING_NAME.pattern}")
    return f"{SERVING}/{name}"


def steps_of(dir_names: Iterable[str]) -> list[int]:
    """The steps among directory names (``storage.list_dirs(root)``), ascending."""
    return sorted(s for n in dir_names if (s := parse_step_dir(n)) is not None)


def committed_steps(keys: Iterable[str], root: str) -> list[int]:
    """Steps ``s`` with ``root/step=NNNNNN/_manifest.json`` among ``keys`` (one listing of
    ``root``), ascending."""
    steps = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == root and parts[2] == MANIFEST_NAME:
            step = parse_step_dir(parts[1])
            if step is not None:
                steps.add(step)
    return sorted(steps)


def committed_versions(versions: Mapping[str, str], root: str) -> dict[int, str]:
    """``{step: version of its completion marker}`` from :meth:`Storage.list_versions` of
    ``root``: a step whose marker was rewritten has another version."""
    return {s: versions[f"{root}/{step_dir(s)}/{MANIFEST_NAME}"]
            for s in committed_steps(versions, root)}


def odd_entries(keys: Iterable[str], root: str) -> list[str]:
    """Names directly under ``root`` among ``keys`` (one listing of ``root``) that are not
    step directories as :func:`step_dir` writes them (``step=0003``, ``step=²``, a stray
    file), sorted: what a reader of the steps skips."""
    odd = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) >= 2 and parts[0] == root and parse_step_dir(parts[1]) is None:
            odd.add(parts[1])
    return sorted(odd)


def step_of_prefix(prefix: str, root: str) -> int | None:
    """The step of a ``root/step=NNNNNN`` prefix, or None."""
    head, _, name = prefix.strip("/").rpartition("/")
    return parse_step_dir(name) if head == root else None
