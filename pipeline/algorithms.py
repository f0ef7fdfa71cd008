"""The drafter algorithms Aerie trains, evaluates and serves: each registered once, here.

Adding an algorithm is one package that builds its
:class:`~pipeline.drafters.algorithm.DrafterAlgorithm` and one entry in :data:`ALGORITHMS`.
Lookups refuse what no algorithm claims with an :class:`UnknownAlgorithmError` that names
the value and the algorithms there are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.dflash.algorithm import DFLASH
from pipeline.drafters.algorithm import DrafterAlgorithm
from pipeline.eagle3.algorithm import EAGLE3, EAGLE31
from pipeline.eagle3.spec import SpecParams

if TYPE_CHECKING:
    from torch import nn

    from pipeline.drafters.protocol import Drafter

ALGORITHMS: dict[str, DrafterAlgorithm] = {a.name: a for a in (EAGLE3, EAGLE31, DFLASH)}
DEFAULT_ALGORITHM = EAGLE3.name
CONFIG_NAME = "config.json"


class UnknownAlgorithmError(ValueError):
    """A name, export or model that no registered drafter algorithm claims."""


def algorithm(name: str) -> DrafterAlgorithm:
    """The algorithm registered as ``name``."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise UnknownAlgorithmError(f"drafter algorithm {name!r} is not one of "
                                    f"{sorted(ALGORITHMS)}") from None


def algorithm_of_config(config: Mapping[str, Any], where: str) -> DrafterAlgorithm:
    """The one algorithm that claims the export ``config`` (a ``config.json`` read from
    ``where``)."""
    architectures = config.get("architectures")
    names = architectures if isinstance(architectures, list) else []
    listed = [a for a in ALGORITHMS.values() if any(n in a.architectures for n in names)]
    if not listed:
        known = sorted({n for a in ALGORITHMS.values() for n in a.architectures})
        raise UnknownAlgorithmError(f"{where}: architectures {architectures!r} name no "
                                    f"drafter algorithm Aerie knows (one of {known})")
    claimed = [a for a in listed if a.claims(config)]
    if len(claimed) != 1:
        raise UnknownAlgorithmError(
            f"{where}: {len(claimed)} of the algorithms {[a.name for a in listed]} claim this "
            f"export; its keys match {'none' if not claimed else [a.name for a in claimed]}")
    return claimed[0]


def algorithm_of_directory(directory: str | Path) -> DrafterAlgorithm:
    """The algorithm of the drafter exported in ``directory``, from its ``config.json``."""
    return algorithm_of_config(read_config(directory), str(Path(directory) / CONFIG_NAME))


def algorithm_of_model(model: object) -> DrafterAlgorithm:
    """The algorithm of a model in training or decoding: the one whose model it is and whose
    export its config would be."""
    for a in ALGORITHMS.values():
        if a.is_model(model) and a.claims(a.config_json(model.config)):  # type: ignore[attr-defined]
            return a
    raise UnknownAlgorithmError(f"{type(model).__name__} is no drafter algorithm's model "
                                f"({sorted(ALGORITHMS)})")


def read_config(directory: str | Path) -> dict[str, Any]:
    """The ``config.json`` of the export in ``directory``, as a JSON object."""
    path = Path(directory) / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnknownAlgorithmError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(config, dict):
        raise UnknownAlgorithmError(f"{path}: is not a JSON object")
    return config


def serving_of(config: Mapping[str, Any], settings: SpecParams, where: str
               ) -> tuple[DrafterAlgorithm, SpecParams]:
    """The algorithm of the export whose ``config.json`` is ``config`` (read from ``where``)
    and the settings it is served and measured with, given the deployment's ``settings``."""
    found = algorithm_of_config(config, where)
    return found, found.settings_for(config, settings)


def trained_layers(name: str, captured: tuple[int, ...], target: Mapping[str, Any]
                   ) -> tuple[int, ...]:
    """The captured layers a drafter of algorithm ``name`` trains on: its default layers for
    ``target`` (a ``config.json``) when the window holds every one of them (a window captured
    for several algorithms), else all the window holds (the capture's choice)."""
    default = algorithm(name).default_layer_ids(int(target["num_hidden_layers"]),
                                                target.get("model_type"))
    return tuple(default) if set(default) <= set(captured) else tuple(captured)


def format_errors(directory: str | Path) -> tuple[str, ...]:
    """Every reason ``directory`` is not a loadable export of a registered algorithm, by
    that algorithm's own check; empty when it is one. Never raises for a bad export."""
    if not (Path(directory) / CONFIG_NAME).is_file():
        return (f"{CONFIG_NAME} is missing",)
    try:
        found = algorithm_of_directory(directory)
    except UnknownAlgorithmError as e:
        return (str(e),)
    return found.format_errors(Path(directory))


def served_name_known(sglang_algorithm: object) -> bool:
    """Whether SGLang reports serving an algorithm Aerie knows (its ``speculative_algorithm``,
    case-insensitive)."""
    return any(str(sglang_algorithm).upper() == a.sglang_algorithm for a in ALGORITHMS.values())


def as_drafter(obj: nn.Module | Drafter) -> Drafter:
    """An algorithm's model wrapped in its proposer for the engine, or a :class:`Drafter`
    as is. (Algorithms that share a model share its proposer: the model's config decides.)"""
    from pipeline.drafters.protocol import Drafter  # torch: only where drafting runs

    for a in ALGORITHMS.values():
        if a.is_model(obj):
            return a.proposer(obj)
    if isinstance(obj, Drafter):
        return obj
    raise TypeError(f"{type(obj).__name__} is neither a drafter algorithm's model "
                    f"({sorted(ALGORITHMS)}) nor a Drafter")
