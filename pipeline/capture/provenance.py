"""Where a shard's states came from, and the conventions a reader must read them with.

Every shard footer (``aerie.provenance``) and every shard manifest (``meta.provenance``)
carries one :func:`provenance` record:

=======================  ========================================================
key                      meaning
=======================  ========================================================
engine                   what computed the states: ``transformers`` (the ``hf``
                         backend) or ``sglang`` (its HTTP servers)
engine_version           that engine's version (SGLang: what ``/server_info`` said;
                         several, comma-joined, when the servers disagreed)
aux_capture              what aux id ``l`` means: :data:`AUX_CAPTURE` (output of
                         decoder layer ``l``, before any norm)
aux_layer_ids            the ids in that convention
engine_aux_layer_ids     the same layers as the engine was asked for them
                         (SGLang: ``--return-aux-hidden-state-layer-ids``, which
                         its models turn into ``id + 1`` on entry)
final_capture            ``post_norm``: ``final_hidden`` is after the final norm
encoding                 how the state bytes are stored (:data:`ENCODINGS`):
                         ``bfloat16``, ``fp8-aux`` (aux states as float8
                         e4m3 with a per-token scale) or ``fp8`` (both)
=======================  ========================================================

The engine and its version are a record, not part of a step's fingerprint: upgrading an
engine does not throw committed steps away. The conventions are checks:
:func:`check_provenance` refuses a shard whose aux convention, final-state convention,
encoding or layer ids differ from what the reader reads, naming the field. Shards written
before provenance was recorded carry none and were written in these conventions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from pipeline.eagle3.aux_layers import AUX_CAPTURE

__all__ = ["ENCODING", "ENCODINGS", "FINAL_CAPTURE", "Encoding", "backend_identity",
           "backend_provenance", "check_provenance", "provenance"]

FINAL_CAPTURE = "post_norm"
ENCODING = "bfloat16"  # the default, and the dtype every reader hands states out in
Encoding = Literal["bfloat16", "fp8-aux", "fp8"]
ENCODINGS: tuple[str, ...] = get_args(Encoding)


def provenance(engine: str, engine_version: str, aux_layer_ids: Sequence[int],
               engine_aux_layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """One provenance record in Aerie's conventions (see the module table), of bf16 states;
    the capture stage sets ``encoding`` to what it stores."""
    ids = [int(i) for i in aux_layer_ids]
    return {"engine": engine, "engine_version": engine_version, "aux_capture": AUX_CAPTURE,
            "aux_layer_ids": ids,
            "engine_aux_layer_ids": [int(i) for i in (engine_aux_layer_ids
                                                      if engine_aux_layer_ids is not None
                                                      else ids)],
            "final_capture": FINAL_CAPTURE, "encoding": ENCODING}


def backend_identity(backend: Any) -> dict[str, Any]:
    """What identifies a capture backend's output (its ``describe()``, at least its name):
    part of a step's fingerprint."""
    describe = getattr(backend, "describe", None)
    identity = dict(describe()) if callable(describe) else {}
    identity.setdefault("backend", getattr(backend, "name", type(backend).__name__))
    return identity


def backend_provenance(backend: Any, identity: dict[str, Any], aux_ids: Sequence[int],
                       encoding: str) -> dict[str, Any]:
    """The backend's own record (``provenance()``), or one that names it by its identity,
    with the ``encoding`` the shards store."""
    own = getattr(backend, "provenance", None)
    record = dict(own()) if callable(own) else provenance(str(identity["backend"]),
                                                          "unknown", aux_ids)
    return {**record, "encoding": encoding}


def check_provenance(record: Mapping[str, Any], aux_layer_ids: Sequence[int], where: str,
                     encoding: str = ENCODING) -> None:
    """Raise ``ValueError`` naming ``where`` and the field when ``record`` was not captured
    in the conventions this release reads, or names other aux layers than ``aux_layer_ids``
    or another encoding than the data's own ``encoding``."""
    expected = {"aux_capture": AUX_CAPTURE, "final_capture": FINAL_CAPTURE,
                "encoding": encoding, "aux_layer_ids": [int(i) for i in aux_layer_ids]}
    for key, want in expected.items():
        got = record.get(key)
        if got != want:
            raise ValueError(f"{where}: provenance {key} is {got!r}; this release reads "
                             f"{want!r} (states from {record.get('engine', '?')} "
                             f"{record.get('engine_version', '?')}): capture the step again")
