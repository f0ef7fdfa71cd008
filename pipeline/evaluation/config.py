"""What the evaluation stage measures (:class:`EvalConfig`).

Torch-free, so that Dagster run config can mirror it without loading torch with the
definitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from pipeline.eagle3.spec import SpecParams
from pipeline.sampling import FIELDS, SamplingParams

Device = Literal["cpu", "cuda", "auto"]  # auto: CUDA when present
Dtype = Literal["float32", "bfloat16"]
DEVICES, DTYPES = get_args(Device), get_args(Dtype)


@dataclass(frozen=True)
class EvalConfig:
    """What is measured: prompt count, generation length, SGLang's speculative settings,
    the sampler, and where the models run.

    ``num_steps``/``eagle_topk``/``num_draft_tokens``: all three or none (None: SGLang's
    auto choice for the target's architecture, DESIGN §5). ``reference_prompts``: how many
    prompts (the longest) are also decoded greedily by the independent cache-free reference.

    Sampler: ``temperature``/``top_p``/``top_k``/``min_p`` left None take the settings the
    newest rollout snapshot records (:meth:`sampler`); each one set overrides that field
    (``temperature=0``: greedy). ``seed`` seeds the draws of a sampled evaluation.
    ``device`` (cpu | cuda | auto) and ``dtype`` (float32 | bfloat16) place target and
    drafters; ``confidence`` is the level of the bootstrap intervals over prompts.
    """

    max_prompts: int = 32
    max_new_tokens: int = 128
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    reference_prompts: int = 4
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int = 0
    device: Device = "cpu"
    dtype: Dtype = "float32"
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.max_prompts < 1 or self.max_new_tokens < 1 or self.reference_prompts < 1:
            raise ValueError("max_prompts, max_new_tokens and reference_prompts must be >= 1")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")
        self.sampler(None)  # a bad override fails here, naming its field

    def sampler(self, recorded: SamplingParams | None) -> SamplingParams:
        """The recorded sampler (greedy when none) with this config's overrides applied."""
        base = (recorded or SamplingParams()).to_dict()
        given = {name: getattr(self, name) for name in FIELDS
                 if getattr(self, name) is not None}
        return SamplingParams.from_mapping(base | given)

    @property
    def overrides_sampler(self) -> bool:
        return any(getattr(self, name) is not None for name in FIELDS)

    def spec_params(self, architectures: Sequence[str] | None) -> SpecParams:
        given = (self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if all(v is None for v in given):
            return SpecParams.auto_for(architectures)
        if any(v is None for v in given):
            raise ValueError("set num_steps, eagle_topk and num_draft_tokens together, or none")
        return SpecParams(*given)
