"""DFlash drafter configuration: derived from the target, written as the engines' config.json.

A DFlash drafter (SGLang 0.5.23 ``DFlashDraftModel``, vLLM 0.33 ``qwen3_dflash``) is ``L``
Qwen3-style decoder layers with no embedding and no head of its own: it reads the target's
embedding and ``lm_head``, so its width is the target's. ``K`` target layers feed it (the
``target_layer_ids``, Aerie's numbering of :mod:`pipeline.eagle3.aux_layers`: the output of
decoder layer ``l``), projected once by ``fc`` (K·H → H) and ``hidden_norm`` into the context
its layers attend to. It proposes a whole block of ``block_size`` positions in one pass: the
anchor (the last verified token) and ``block_size - 1`` mask tokens.

Invariants:

- ``block_size`` counts the anchor, as SGLang's ``--speculative-num-draft-tokens`` does;
  vLLM's ``num_speculative_tokens`` is ``block_size - 1`` (the engines count differently:
  :mod:`pipeline.dflash.algorithm` writes each its own number).
- The layer ids are written where both engines read them: ``dflash_config.target_layer_ids``
  (both add 1 internally), and nothing at the top level (vLLM would read a top-level
  ``eagle_aux_hidden_state_layer_ids`` first).
- ``mask_token_id`` is a row of the target's vocab (SGLang does not resize the embedding):
  the target config's own ``mask_token_id`` when it has one, else the last row.
- Only targets whose engine models expose DFlash's capture hook are drafted for
  (:data:`HOSTS`); others are refused up front, naming the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.eagle3.aux_layers import AUX_CAPTURE, check_aux_layer_ids
from pipeline.eagle3.config import (
    SUPPORTED_ROPE_TYPES,
    DrafterShape,
    config_getter,
    drafter_rope,
    read_rope,
)

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_LAYERS = 5  # SpecForge, speculators and the published drafters
DEFAULT_BLOCK_SIZE = 8  # ModelOpt's default (SpecForge uses 16 for Qwen3-8B)
# model types whose SGLang 0.5.23 model implements ``set_dflash_layers_to_capture`` (and
# that vLLM 0.33 drafts for with qwen3_dflash), among the families Aerie trains for
HOSTS = ("llama", "mistral", "qwen3", "qwen3_moe")  # SGLang: Mistral is its Llama class


def default_target_layer_ids(num_layers: int, layers: int = DEFAULT_LAYERS) -> tuple[int, ...]:
    """The engines' and SpecForge's default: ``[N // 2]`` for one draft layer, else ``layers``
    ids spread as ``round(1 + i (N - 4) / (layers - 1))`` (Qwen3-8B: 1, 9, 17, 25, 33).
    Targets too shallow for that many distinct ids get as many as ``[1, N - 2]`` holds."""
    if layers == 1:
        return (num_layers // 2,)
    ids = sorted({round(1 + i * (num_layers - 4) / (layers - 1)) for i in range(layers)})
    ids = [i for i in ids if 0 <= i <= num_layers - 2]
    if len(ids) < min(layers, max(1, num_layers - 1)):  # shallow: every layer from 0
        ids = list(range(min(layers, num_layers - 1)))
    return tuple(ids)


def default_mask_token_id(target: Any) -> int:
    """The target config's ``mask_token_id`` when set, else its last vocab row."""
    get = config_getter(target)
    own = get("mask_token_id", None)
    return int(own) if own is not None else int(get("vocab_size")) - 1


def check_host(target: Any) -> str:
    """The target's ``model_type``, or a ValueError naming why DFlash cannot be served for it."""
    model_type = config_getter(target)("model_type", None)
    if model_type not in HOSTS:
        raise ValueError(f"DFlash cannot be served for a {model_type!r} target: the engines "
                         f"capture DFlash's target layers only in the models of {list(HOSTS)}")
    return str(model_type)


@dataclass(frozen=True)
class DFlashConfig:
    """Shapes and settings of a DFlash drafter (module docstring)."""

    hidden_size: int  # = the target's
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocab: the drafter drafts over all of it
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", check_aux_layer_ids(
            self.target_layer_ids, self.num_target_layers, where="target_layer_ids"))
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} must be >= 2 (the anchor and at "
                             f"least one draft token)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of the "
                             f"target's vocab [0, {self.vocab_size})")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ValueError(f"{self.num_attention_heads} heads over "
                             f"{self.num_key_value_heads} KV heads of size {self.head_dim}: "
                             f"heads must be a multiple of KV heads, head_dim even")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported "
                             f"(supported: {SUPPORTED_ROPE_TYPES})")

    # what RotaryEmbedding reads
    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return {"rope_type": "default", **(self.rope_scaling or {}),
                "rope_theta": float(self.rope_theta)}

    @property
    def draft_tokens(self) -> int:
        """Tokens one block proposes (vLLM's ``num_speculative_tokens``)."""
        return self.block_size - 1

    @property
    def fc_in_features(self) -> int:
        return self.hidden_size * len(self.target_layer_ids)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers captured for it (the capture's and the engine's name)."""
        return self.target_layer_ids

    @classmethod
    def from_target(cls, target: Any, *, aux_layer_ids: Sequence[int] | None = None,
                    shape: DrafterShape = DrafterShape(), layers: int = DEFAULT_LAYERS,
                    block_size: int = DEFAULT_BLOCK_SIZE, mask_token_id: int | None = None,
                    **_: Any) -> DFlashConfig:
        """The DFlash drafter of ``target`` (a config object or ``config.json`` dict).

        ``aux_layer_ids`` default to :func:`default_target_layer_ids`; ``shape`` may re-lay
        out the heads but not the width (the drafter reads the target's embedding and
        head); ``mask_token_id`` defaults to :func:`default_mask_token_id`. Keywords other
        algorithms take (``draft_vocab_size``) are ignored: DFlash drafts the whole vocab.
        """
        check_host(target)
        get = config_getter(target)
        num_layers = int(get("num_hidden_layers"))
        width = int(get("hidden_size"))
        if shape.hidden_size not in (0, width):
            raise ValueError(f"a DFlash drafter is as wide as its target ({width}); drafter "
                             f"hidden_size {shape.hidden_size} cannot be")
        widths = shape.resolve(target)
        theta, scaling = drafter_rope(target, widths["head_dim"])
        return cls(
            **widths, num_hidden_layers=layers, rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings")),
            vocab_size=int(get("vocab_size")), num_target_layers=num_layers,
            target_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None
            else default_target_layer_ids(num_layers, layers),
            block_size=block_size,
            mask_token_id=default_mask_token_id(target) if mask_token_id is None
            else mask_token_id)

    def to_config_json(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The ``config.json`` both engines' DFlash loaders read."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": float(self.rope_theta),
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": self.rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "sliding_window": None, "vocab_size": self.vocab_size, "torch_dtype": dtype,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id, "block_size": self.block_size,
                              "target_layer_capture": AUX_CAPTURE},
        }

    @classmethod
    def from_config_json(cls, cfg: Mapping[str, Any]) -> DFlashConfig:
        """Inverse of :meth:`to_config_json`; a ValueError names what an export gets wrong."""
        if ARCHITECTURE not in (cfg.get("architectures") or []):
            raise ValueError(f"config.json architectures {cfg.get('architectures')} do not "
                             f"include {ARCHITECTURE}")
        nested = cfg.get("dflash_config")
        if not isinstance(nested, Mapping):
            raise ValueError("config.json lacks dflash_config")
        for key in ("target_layer_ids", "mask_token_id"):
            if key not in nested:
                raise ValueError(f"config.json lacks dflash_config.{key}")
        convention = nested.get("target_layer_capture", AUX_CAPTURE)
        if convention != AUX_CAPTURE:
            raise ValueError(f"config.json: target layers captured as {convention!r}; this "
                             f"release trains and evaluates {AUX_CAPTURE!r}")
        if "eagle_aux_hidden_state_layer_ids" in cfg:
            raise ValueError("config.json: a top-level eagle_aux_hidden_state_layer_ids "
                             "overrides dflash_config.target_layer_ids in vLLM")
        for key in ("causal", "use_swa", "attention_sink_bias"):
            if nested.get(key):
                raise ValueError(f"config.json sets dflash_config.{key}: this release's "
                                 f"DFlash drafter computes non-causal, full-attention blocks")
        if cfg.get("is_causal"):
            raise ValueError("config.json sets is_causal: this release's DFlash drafter "
                             "computes non-causal blocks")
        if cfg.get("is_neox_style", True) is not True:
            raise ValueError("config.json sets is_neox_style false: this release's DFlash "
                             "drafter rotates the halves layout (a mismatch is silent in "
                             "vLLM)")
        block = nested.get("block_size", cfg.get("block_size"))
        if cfg.get("block_size") is not None and block != cfg.get("block_size"):
            raise ValueError(f"config.json: block_size {cfg.get('block_size')} and "
                             f"dflash_config.block_size {block} differ")
        theta, scaling = read_rope(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            vocab_size=int(cfg["vocab_size"]),
            num_target_layers=int(cfg["num_target_layers"]),
            target_layer_ids=tuple(nested["target_layer_ids"]),
            block_size=int(block if block is not None else DEFAULT_BLOCK_SIZE),
            mask_token_id=int(nested["mask_token_id"]))


def shapes_match(a: DFlashConfig, b: DFlashConfig) -> bool:
    """Every weight of ``a`` and ``b`` has the same shape (a warm start needs this)."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    return (all(getattr(a, k) == getattr(b, k) for k in keys)
            and len(a.target_layer_ids) == len(b.target_layer_ids))
