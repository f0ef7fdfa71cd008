"""The record one drafter algorithm registers: everything that differs between algorithms.

A stage never names an algorithm's modules: it looks the algorithm up by name
(:func:`pipeline.algorithms.algorithm`), by an export's ``config.json``
(:func:`pipeline.algorithms.algorithm_of_directory`), and calls what the record holds.

Invariants:

- ``name`` is Aerie's name for the algorithm (configuration, reports, tags); the SGLang and
  vLLM names are the engines' own (``--speculative-algorithm``, ``speculative_config.method``).
- An export names its algorithm: exactly one registered algorithm lists one of its
  ``config.json`` ``architectures`` and ``claims`` it (EAGLE-3 and EAGLE 3.1 share an
  architecture and engine names; the 3.1 keys tell them apart).
- Light to import: a record holds functions that import the model code (torch) when
  called, so loading the code location (which reads the serving flags) stays torch-free.
- The serving flags are built here from the algorithm's names and its own settings, so every
  launcher (serving modes, ``aerie serving-args``, the engine evaluator) emits the same flags.
- Training goes through the record too: the trainer builds the model (:attr:`new_config`,
  :attr:`build`), runs :attr:`objective` on :attr:`collate`'s batches under DeepSpeed, and
  saves a :attr:`fresh` copy with :attr:`save`; the capture records :attr:`default_layer_ids`
  when the deployment names no layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from pipeline.drafters.protocol import Drafter
    from pipeline.eagle3.spec import SpecParams


@dataclass(frozen=True)
class DrafterAlgorithm:
    """One drafter algorithm (module docstring)."""

    name: str  # Aerie's name: "eagle3"
    title: str  # for people: "EAGLE-3"
    architectures: tuple[str, ...]  # what config.json "architectures" names in an export
    # whether an export's config.json (with one of those architectures) is this algorithm's:
    # algorithms that share an architecture tell their exports apart by other keys
    claims: Callable[[Mapping[str, Any]], bool]
    sglang_algorithm: str  # SGLang's --speculative-algorithm
    vllm_method: str  # vLLM's speculative_config "method"
    # (config, the target's embedding, head=, d2t=, t2d=) -> the model it trains and decodes
    # with (head: the target's lm_head weight; d2t/t2d: the draft vocab, where it has one)
    build: Callable[..., nn.Module]
    is_model: Callable[[object], bool]  # whether an object is such a model
    # (the target's config, draft_vocab_size=, aux_layer_ids=, shape=, train=) -> the
    # model's config (train: the TrainConfig whose settings of this algorithm apply)
    new_config: Callable[..., Any]
    config_json: Callable[[Any], dict[str, Any]]  # a model config -> its export config.json
    # (target decoder layers, model_type) -> the target layers captured for it by default
    default_layer_ids: Callable[[int, str | None], tuple[int, ...]]
    # (directory, the target's input embedding, head=, dtype=, device=) -> model
    load: Callable[..., nn.Module]
    format_errors: Callable[[Path], tuple[str, ...]]  # every reason an export won't load
    proposer: Callable[[nn.Module], Drafter]  # the in-process engine's drafter for a model
    # training: (model, the run's TrainConfig) -> a module whose forward(batch) is
    # (loss, TTTMetrics) and whose .depth counts the metric slots
    objective: Callable[[nn.Module, Any], nn.Module]
    # (shard samples, target=TargetWeights, model=, device=) -> the objective's batch
    collate: Callable[..., Any]
    fresh: Callable[[nn.Module, Any], nn.Module]  # (model, target weights) -> a CPU copy
    save: Callable[..., Path]  # (model, directory, dtype=) -> the export, replaced if there
    # (model, directory, label) -> the warm start's record, the weights copied when it fits
    warm_start: Callable[[nn.Module, Path, str], dict[str, Any]]
    # (an export's config.json, the deployment's settings) -> the settings it is served and
    # measured with (EAGLE: the deployment's; DFlash: a chain as long as its block)
    settings_for: Callable[[Mapping[str, Any], SpecParams], SpecParams]
    sglang_settings: Callable[[SpecParams], tuple[str, ...]]  # flags after the draft path
    # the (speculative_num_steps, eagle_topk, num_draft_tokens) SGLang's /server_info reports
    # when serving with these settings, and back (SGLang forces DFlash's steps to 1)
    sglang_reported: Callable[[SpecParams], tuple[int, int, int]]
    from_sglang_reported: Callable[[int, int, int], SpecParams]
    vllm_settings: Callable[[SpecParams], Mapping[str, Any]]  # speculative_config entries

    def sglang_args(self, settings: SpecParams, drafter_dir: str) -> tuple[str, ...]:
        """SGLang's flags that serve this algorithm's drafter from ``drafter_dir``."""
        return ("--speculative-algorithm", self.sglang_algorithm,
                "--speculative-draft-model-path", drafter_dir, *self.sglang_settings(settings))

    def vllm_speculative_config(self, settings: SpecParams, drafter_dir: str) -> str:
        """vLLM's ``--speculative-config`` JSON that serves this algorithm's drafter."""
        return json.dumps({"method": self.vllm_method, "model": drafter_dir,
                           **self.vllm_settings(settings)}, separators=(",", ":"))


def scratch(label: str | None, reason: str) -> dict[str, Any]:
    """The warm-start record of a run that starts from scratch, and why (every algorithm's
    ``warm_start`` returns this shape)."""
    return {"mode": "scratch", "source": label, "reason": reason, "lm_head_rows_carried": 0}
