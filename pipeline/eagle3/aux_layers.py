"""Which target layers feed the drafter: EAGLE-3's aux layer ids, one convention everywhere.

Aerie's convention, :data:`AUX_CAPTURE` (``"layer_output"``): aux id ``l`` (0-based over the
target's N decoder layers) is the residual stream after decoder layer ``l``, the input of
layer ``l + 1``, before any final norm. Aerie's capture backends record it, shard manifests
and the drafter's ``config.json`` name it, and training and evaluation check it.

The serving engines number the same states differently (SGLang 0.5.23, vLLM 0.33.0, read in
their source):

- SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures ``id + 1``
  on entry to that layer: the output of layer ``id``, Aerie's numbering. Its Llama and Qwen
  models never reach index N, so ``l = N - 1`` would silently yield one state too few (an
  IndexError on Qwen-MoE). Its DeepSeek model adds the ``+ 1`` only when the first id is 1.
- vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` first (its V2 runner reads
  only that key) and numbers states after each layer: id ``k`` is the output of layer
  ``k - 1`` (0: the embeddings). It needs ``l + 1``.

So an export writes both lists (:func:`engine_ids`), and the ids themselves must be what
every engine can capture (:func:`check_aux_layer_ids`): distinct, strictly ascending (the
engines emit states in layer order; the drafter's ``fc`` takes them concatenated in that
order), each in ``[0, N - 2]``, and starting at 1 for DeepSeek targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

AUX_CAPTURE = "layer_output"  # aux id l = output of decoder layer l, before the final norm
# SGLang's DeepSeek model shifts the ids only when the first one is 1
_FIRST_ID_ONE = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def check_aux_layer_ids(ids: Sequence[Any], num_layers: int | None = None, *,
                        model_type: str | None = None, where: str = "aux_layer_ids",
                        ) -> tuple[int, ...]:
    """``ids`` as a tuple of ints, or a ValueError naming ``where`` and what is wrong.

    ``num_layers`` (the target's decoder layers), when known, bounds them to ``[0, N - 2]``;
    ``model_type`` adds SGLang's DeepSeek rule.
    """
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not ids:
        raise ValueError(f"{where} must be a non-empty list of layer ids, got {ids!r}")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{where} {list(ids)!r}: every id must be an integer")
    out = tuple(int(i) for i in ids)
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"{where} {list(out)}: ids must be distinct and ascending (the "
                         f"engines capture each layer once, in layer order)")
    if out[0] < 0:
        raise ValueError(f"{where} {list(out)}: ids start at 0")
    if num_layers is not None and out[-1] > num_layers - 2:
        raise ValueError(f"{where} {list(out)}: for a {num_layers}-layer target the ids must "
                         f"be in [0, {num_layers - 2}]; id {num_layers - 1} (the last layer's "
                         f"output) is not captured by SGLang's Llama/Qwen models")
    if model_type in _FIRST_ID_ONE and out[0] != 1:
        raise ValueError(f"{where} {list(out)}: a {model_type} target needs the first id to "
                         f"be 1 (SGLang shifts DeepSeek ids only then)")
    return out


def engine_default_ids(num_layers: int) -> tuple[int, int, int]:
    """The layers SGLang, vLLM and SpecForge capture when given no ids, in Aerie's numbering:
    ``[1, N//2 - 1, N - 4]`` (SGLang's ``[2, N//2, N - 3]`` before its capture shift),
    duplicates and all for shallow targets."""
    return 1, num_layers // 2 - 1, num_layers - 4


def default_aux_layer_ids(num_layers: int, model_type: str | None = None
                          ) -> tuple[int, int, int]:
    """The engines' default layers (:func:`engine_default_ids`) when those are distinct;
    for targets too shallow for that, three ids spread over ``[1, N - 2]`` (``[0, 2]`` for
    four layers, except for a DeepSeek-style target, whose first id must be 1). Too shallow
    for three distinct ids: a ValueError."""
    classic = engine_default_ids(num_layers)
    if classic[0] < classic[1] < classic[2]:
        return classic
    low, high = (1 if num_layers >= 5 or model_type in _FIRST_ID_ONE else 0), num_layers - 2
    if high - low < 2:
        kind = f"{num_layers}-layer" + (f" {model_type}" if model_type else "")
        raise ValueError(f"a {kind} target has no three "
                         f"distinct aux layers in [{low}, {high}]; pass aux_layer_ids "
                         "explicitly")
    return low, (low + high) // 2, high


def engine_ids(ids: Sequence[int]) -> dict[str, Any]:
    """The ``config.json`` keys that make SGLang and vLLM capture the outputs of layers
    ``ids``: the nested list for SGLang (and SpecForge), the top-level ``+ 1`` list for
    vLLM, the count for both engines' ``fc``, and Aerie's convention name."""
    return {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids),
                         "use_aux_hidden_state": True,
                         "aux_hidden_state_capture": AUX_CAPTURE},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "num_aux_hidden_states": len(ids),
    }


def ids_from_config(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The aux ids (Aerie's numbering) of an EAGLE-3 ``config.json``: the nested SGLang
    list; a top-level vLLM list, when present, must name the same layers; a recorded
    convention other than :data:`AUX_CAPTURE` is refused."""
    eagle = cfg.get("eagle_config") or {}
    nested = eagle.get("eagle_aux_hidden_state_layer_ids")
    if nested is None:
        raise ValueError("config.json lacks eagle_config.eagle_aux_hidden_state_layer_ids")
    ids = check_aux_layer_ids(nested, where="eagle_config.eagle_aux_hidden_state_layer_ids")
    convention = eagle.get("aux_hidden_state_capture", AUX_CAPTURE)
    if convention != AUX_CAPTURE:
        raise ValueError(f"config.json: aux states captured as {convention!r}; this release "
                         f"trains and evaluates {AUX_CAPTURE!r}")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and list(top) != [i + 1 for i in ids]:
        raise ValueError(f"config.json: top-level eagle_aux_hidden_state_layer_ids {top} "
                         f"(vLLM's numbering) do not name the layers {list(ids)} of "
                         f"eagle_config (SGLang's): expected {[i + 1 for i in ids]}")
    count = cfg.get("num_aux_hidden_states")
    if count is not None and count != len(ids):
        raise ValueError(f"config.json: num_aux_hidden_states {count} but {len(ids)} aux ids")
    return ids
