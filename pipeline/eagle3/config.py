"""Drafter configuration: derived from the target's config, written as SGLang's config.json.

:class:`DrafterConfig` is the one source of truth for the drafter's shapes. It is built from
the target (an HF ``LlamaConfig``-like object or its ``config.json`` dict) and turned into
the ``config.json`` SGLang's ``LlamaForCausalLMEagle3`` loads (DESIGN §5).

Invariants:

- Rope: transformers 5 keeps ``rope_theta`` and the scaling parameters under
  ``rope_parameters``; older configs keep ``rope_theta``/``rope_scaling`` at the top level.
  Both are read (``rope_parameters`` first). The written config.json carries them in BOTH
  places, with the same values, because converters and older loaders read only the
  top-level keys and silently fall back to ``rope_theta = 10000``.
- ``aux_layer_ids`` follow :mod:`pipeline.eagle3.aux_layers` (Aerie's numbering: the output
  of decoder layer ``l``): checked when a config is built or read, defaulting to
  ``[1, N//2 - 1, N - 4]`` when distinct, and written for SGLang (nested) and vLLM
  (top-level, ``l + 1``) alike.
- ``draft_vocab_size <= vocab_size`` (capped); ``target_hidden_size`` is written only when it
  differs from ``hidden_size`` (SGLang then sizes ``fc`` from it).
- Width (:class:`DrafterShape`): the drafter copies the target's width and attention layout
  unless told otherwise or the target's attention is too wide to copy (MLA, more than 64
  heads: DeepSeek-V3's 128 heads would make a ~1.2B drafter); then heads are 128 wide
  (fewer for tiny targets) with up to 8 KV heads (the largest count that divides them). A
  drafter whose ``hidden_size`` differs from the target's owns its token embedding
  (exported, as SGLang and vLLM then load the draft's own ``embed_tokens`` instead of
  sharing the target's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.eagle3.aux_layers import (
    check_aux_layer_ids,
    default_aux_layer_ids,
    engine_ids,
    ids_from_config,
)

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


WIDE_ATTENTION_HEADS = 64  # targets with more heads (or MLA) get a re-laid-out drafter


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's own widths; 0 = derived from the target (module docstring)."""

    hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"drafter {name} must be an int >= 0 (0: derived from the "
                                 f"target), got {value!r}")

    def resolve(self, target: Any) -> dict[str, int]:
        """Concrete widths for ``target`` (a config object or dict)."""
        get = config_getter(target)
        width, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = int(get("head_dim", None) or width // heads)
        kv_heads = int(get("num_key_value_heads", heads) or heads)
        wide = get("kv_lora_rank", None) is not None or heads > WIDE_ATTENTION_HEADS
        hidden = self.hidden_size or width
        copy = hidden == width and not wide and not self.head_dim
        dim = self.head_dim or (head_dim if copy else min(128, 2 * (hidden // 8)))
        n = self.num_attention_heads or (heads if copy else max(1, hidden // dim))
        kv = self.num_key_value_heads or (kv_heads if copy and n == heads else
                                          max(d for d in range(1, 9) if n % d == 0))
        inter = int(get("intermediate_size"))
        if hidden != width:  # the target's MLP ratio, rounded to 64
            inter = max(64, round(inter * hidden / width / 64) * 64)
        return {"hidden_size": hidden, "intermediate_size": self.intermediate_size or inter,
                "num_attention_heads": n, "num_key_value_heads": kv, "head_dim": dim}


@dataclass(frozen=True)
class DrafterConfig:
    """Shapes and hyper-parameters of a one-layer EAGLE-3 drafter."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # target vocab (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows, d2t length
    target_hidden_size: int  # width of one aux state; fc takes len(aux_layer_ids) of them
    aux_layer_ids: tuple[int, ...]
    # rope scaling without rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...};
    # None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    hidden_act: str = "silu"
    # EAGLE 3.1 (both engines read these top-level keys): an RMSNorm over each aux state
    # before ``fc`` (weights ``fc_norm.{i}.weight``), and the normed output fed back as the
    # next step's hidden instead of the un-normed one
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        for name in ("fc_norm", "norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"only SwiGLU (hidden_act 'silu') drafters are supported, got "
                             f"{self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a "
                             f"multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, vocab_size={self.vocab_size}]")
        object.__setattr__(self, "aux_layer_ids", check_aux_layer_ids(self.aux_layer_ids))
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported "
                             f"(supported: {SUPPORTED_ROPE_TYPES})")
        if self.rope_type == "longrope" and not isinstance(
                (self.rope_scaling or {}).get("original_max_position_embeddings"), int):
            raise ValueError("longrope needs rope_scaling.original_max_position_embeddings "
                             "(an int), where its long factors begin")

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def owns_embedding(self) -> bool:
        """A drafter of another width than its target carries its own token embedding."""
        return self.hidden_size != self.target_hidden_size

    @property
    def fc_in_features(self) -> int:
        return self.target_hidden_size * len(self.aux_layer_ids)

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers-5 style: ``rope_type``, ``rope_theta`` and any scaling fields."""
        return {"rope_type": "default", **(self.rope_scaling or {}),
                "rope_theta": float(self.rope_theta)}

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: Any, *, draft_vocab_size: int = 32000,
                    aux_layer_ids: Sequence[int] | None = None,
                    shape: DrafterShape = DrafterShape()) -> DrafterConfig:
        """The drafter of a decoder-only ``target`` config (object or config.json dict).

        ``draft_vocab_size`` is capped by the target vocab; ``aux_layer_ids`` default to
        :func:`~pipeline.eagle3.aux_layers.default_aux_layer_ids` and are checked against
        the target's depth and model type; ``shape`` sets the drafter's widths (module
        docstring).
        """
        get = config_getter(target)
        num_layers = int(get("num_hidden_layers"))
        model_type = get("model_type", None)
        ids = check_aux_layer_ids(
            aux_layer_ids if aux_layer_ids is not None
            else default_aux_layer_ids(num_layers, model_type),
            num_layers, model_type=model_type)
        widths = shape.resolve(target)
        theta, scaling = drafter_rope(target, widths["head_dim"])
        vocab = int(get("vocab_size"))
        return cls(
            **widths,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings")),
            vocab_size=vocab,
            draft_vocab_size=min(int(draft_vocab_size), vocab),
            target_hidden_size=int(get("hidden_size")),
            aux_layer_ids=ids,
            # the drafter is SGLang's/vLLM's Llama layer, a SiLU-gated MLP, whatever the
            # target's MLP (Gemma's gelu_pytorch_tanh, Phi's, ...): never copied from it
            hidden_act="silu",
        )

    # -- SGLang config.json ------------------------------------------------------------
    def to_sglang_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The ``config.json`` dict SGLang's ``LlamaForCausalLMEagle3`` loads (DESIGN §5)."""
        cfg: dict[str, Any] = {
            "architectures": [SGLANG_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            # Top level for SGLang / transformers 4 / converters; rope_parameters for
            # transformers 5. Same values in both.
            "rope_theta": float(self.rope_theta),
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": self.rope_parameters,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            **engine_ids(self.aux_layer_ids),
        }
        if self.target_hidden_size != self.hidden_size:
            cfg["target_hidden_size"] = self.target_hidden_size
        for name in ("fc_norm", "norm_output"):  # written only when set: EAGLE-3 bytes stay
            if getattr(self, name):
                cfg[name] = True
        return cfg

    @classmethod
    def from_sglang_config(cls, cfg: Mapping[str, Any]) -> DrafterConfig:
        """Inverse of :meth:`to_sglang_config` (also reads other EAGLE-3 config.json files)."""
        if SGLANG_ARCHITECTURE not in (cfg.get("architectures") or []):
            raise ValueError(f"config.json architectures {cfg.get('architectures')} do not "
                             f"include {SGLANG_ARCHITECTURE}")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError("only one-layer drafters are supported")
        ids = ids_from_config(cfg)
        nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        for name in UNSUPPORTED_VARIANTS:
            if cfg.get(name) or nested.get(name):
                raise ValueError(f"config.json sets {name}: {UNSUPPORTED_VARIANTS[name]}")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = read_rope(cfg)
        vocab = int(cfg["vocab_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            aux_layer_ids=ids,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            fc_norm=_flag(cfg, "fc_norm") or _flag(cfg, "use_aux_norm"),  # SGLang reads both
            norm_output=_flag(cfg, "norm_output"),
        )


def _flag(cfg: Mapping[str, Any], name: str) -> bool:
    value = cfg.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"config.json {name} must be true or false, got {value!r}")
    return value


# EAGLE-3 variants in the wild that this drafter does not compute: reading one as plain
# EAGLE-3 would serve other numbers than it was trained for, so it is refused
UNSUPPORTED_VARIANTS = {
    "norm_before_fc": "one RMSNorm over the concatenated aux states (speculators' variant; "
                      "Aerie's EAGLE 3.1 writes fc_norm, a norm per aux state)",
    "norm_before_residual": "the normed hidden as the first layer's residual (vLLM only; "
                            "SGLang does not compute it)",
}


_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                 "target_hidden_size")


def shapes_match(a: DrafterConfig, b: DrafterConfig) -> bool:
    """True when every parameter and buffer of drafters ``a`` and ``b`` has the same shape.

    (The number of aux layers sizes ``fc``; their ids do not.) The EAGLE 3.1 flags must be
    equal too: ``fc_norm`` adds weights, ``norm_output`` changes what the weights compute,
    and an engine reads both at launch. A warm start or a hot swap needs this; a hot swap
    also needs an identical ``d2t``.
    """
    return (all(getattr(a, f) == getattr(b, f) for f in _SHAPE_FIELDS)
            and len(a.aux_layer_ids) == len(b.aux_layer_ids)
            and (a.fc_norm, a.norm_output) == (b.fc_norm, b.norm_output))


def read_rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a config object or dict.

    ``rope_parameters`` (transformers 5) wins; otherwise top-level ``rope_theta`` and
    ``rope_scaling`` (``type`` is accepted for ``rope_type``). Per-layer-type parameters
    (Gemma-3: ``{"full_attention": {...}, "sliding_attention": {...}}``) give the
    full-attention layers' RoPE: the drafter attends over the whole sequence as those do.
    ``rope_scaling`` is None for plain RoPE, else a dict with ``rope_type`` and its
    parameters, never ``rope_theta``.
    """
    get = config_getter(cfg)
    params = get("rope_parameters", None)
    if isinstance(params, Mapping) and params and all(
            isinstance(v, Mapping) for v in params.values()):
        params = params.get("full_attention") or params[sorted(params)[0]]
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = get("rope_theta", None)
        if theta is None:
            raise ValueError("target config has neither rope_parameters.rope_theta nor "
                             "rope_theta")
        theta = float(theta)
        scaling = dict(get("rope_scaling", None) or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if not scaling or scaling == {"rope_type": "default"}:
        return theta, None
    if scaling.get("rope_type") == "longrope" and "original_max_position_embeddings" not in \
            scaling:  # Phi-3's config.json keeps it at the top level
        original = get("original_max_position_embeddings", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
    return theta, dict(sorted(scaling.items()))


# The yarn fields transformers, SGLang and vLLM read alike for a Llama layer. DeepSeek's
# mscale/mscale_all_dim, attention_factor and GPT-OSS's truncate=False change transformers'
# result but not the engines' Llama YaRN, so a drafter carrying them would be trained on one
# rotation and served with another.
_PORTABLE_YARN = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                  "beta_slow")


def drafter_rope(target: Any, head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """The drafter's RoPE for ``target``: the target's (:func:`read_rope`) where every
    engine computes it as transformers does, else the nearest form that they all do.

    The drafter rotates its whole head (the engines' Llama drafter reads no
    ``partial_rotary_factor``). ``dynamic`` NTK becomes plain RoPE (equal to it up to the
    original length in transformers, while SGLang and vLLM scale it statically everywhere);
    ``yarn`` keeps only :data:`_PORTABLE_YARN`; ``longrope`` whose factor lists do not fit
    the drafter's ``head_dim`` (partial rotary, as Phi-4-mini, or another head size) becomes
    plain RoPE.
    """
    theta, scaling = read_rope(target)
    scaling = dict(scaling or {})
    scaling.pop("partial_rotary_factor", None)
    kind = scaling.get("rope_type", "default")
    if kind == "yarn":
        scaling = {k: v for k, v in scaling.items() if k in _PORTABLE_YARN}
    fits = all(len(scaling.get(f) or ()) == head_dim // 2
               for f in ("short_factor", "long_factor"))
    if kind in ("default", "dynamic") or (kind == "longrope" and not fits):
        return theta, None
    return theta, dict(sorted(scaling.items()))


_MISSING = object()


def config_getter(cfg: Any):
    """``get(name, default)`` over a dict or an attribute object; required when no default."""

    def get(name: str, default: Any = _MISSING) -> Any:
        if isinstance(cfg, Mapping):
            value = cfg.get(name, _MISSING)
        else:
            value = getattr(cfg, name, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ValueError(f"target config lacks {name!r}")
            return default
        return value

    return get
