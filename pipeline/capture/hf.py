"""The embedded capture backend: the policy checkpoint run in-process with transformers.

One forward pass per batch of the *base* model (``model.model`` of a ``*ForCausalLM``):
its ``last_hidden_state`` is already the post-final-norm state, and skipping the
``lm_head`` saves a ``(B, T, vocab)`` matmul whose logits EAGLE-3 never stores (teacher
logits are recomputed from ``final_hidden`` at training time). Aux states are taken by
forward hooks on the chosen decoder layers, copied straight into one preallocated
``(B, T, 3H)`` buffer, instead of ``output_hidden_states=True``, which keeps all N + 1
layer outputs alive.

Invariants:

- Row ``t`` of a sample's states belongs to its input token ``t``. Batches are right-padded
  with an attention mask, so real tokens never attend to padding and keep positions
  ``0..T-1``; padding rows are cut off before returning.
- Aux layer id ``l`` is the OUTPUT of decoder layer ``l`` (HF ``hidden_states[l + 1]``),
  concatenated in the order given (low→mid→high); ``final_hidden`` equals HF's
  ``hidden_states[-1]`` (post-norm in transformers 5). Exact, bit for bit, against
  ``model(..., output_hidden_states=True)`` on the same batch. One exception, by design:
  for ``l = N - 1`` HF's entry ``N`` is tied to the post-norm state, while the hook gives
  the raw output of the last layer — what SGLang captures for that id.
- Inference mode, ``eval()``, no KV cache. Batches are split so that ``B * T_max`` stays
  under ``token_budget`` (a longer single sample runs alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.attention_kernels import shape_stable
from pipeline.capture.base import CapturedStates
from pipeline.capture.provenance import provenance
from pipeline.eagle3.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from pipeline.layout import policy_prefix
from pipeline.snapshot.policy import POLICY_KIND
from pipeline.storage import Storage
from pipeline.verified import fetch

DEFAULT_TOKEN_BUDGET = 16384


class HFCaptureBackend:
    """Captures EAGLE-3 target states from a transformers causal LM (Llama-style layout)."""

    name = "hf"

    def __init__(self, model: nn.Module | str | Path, *,
                 aux_layer_ids: Sequence[int] | None = None,
                 dtype: torch.dtype = torch.float32,
                 output_dtype: torch.dtype | None = None,
                 token_budget: int = DEFAULT_TOKEN_BUDGET,
                 pad_token_id: int = 0,
                 device: str | torch.device = "cpu"):
        """``model``: a loaded model or an HF checkpoint dir (loaded in ``dtype``).

        ``output_dtype`` (default: the model's dtype) is what the returned states are cast
        to while they are copied out of the forward pass, e.g. ``torch.bfloat16`` to save
        a later conversion pass.
        """
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        self.model = model.to(device).eval()
        self.base = _base_model(self.model)
        self.layers: nn.ModuleList = self.base.layers
        num_layers = len(self.layers)
        ids = check_aux_layer_ids(
            aux_layer_ids if aux_layer_ids is not None else default_aux_layer_ids(num_layers),
            num_layers, model_type=getattr(self.model.config, "model_type", None))
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.aux_layer_ids: tuple[int, ...] = ids
        self.hidden_size: int = int(self.model.config.hidden_size)
        self.token_budget = token_budget
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.output_dtype = output_dtype or next(self.model.parameters()).dtype

    def describe(self) -> dict[str, Any]:
        """What identifies this backend's output (goes into shard lineage)."""
        params = next(self.model.parameters())
        identity = {"backend": self.name,
                    "model_dtype": str(params.dtype).removeprefix("torch."),
                    "output_dtype": str(self.output_dtype).removeprefix("torch."),
                    "num_layers": len(self.layers), "token_budget": self.token_budget}
        if self.device.type != "cpu":  # CPU steps committed before keep their fingerprint;
            identity["device"] = self.device.type  # a step never mixes CPU and GPU shards
        return identity

    def provenance(self) -> dict[str, Any]:
        """Transformers computed the states; hooks on the aux layers themselves."""
        import transformers

        return provenance("transformers", transformers.__version__, self.aux_layer_ids)

    def capture(self, batch: Sequence[Sequence[int]]) -> list[CapturedStates]:
        out: list[CapturedStates] = []
        for group in _budget_groups([len(ids) for ids in batch], self.token_budget):
            out.extend(self._capture_padded([batch[i] for i in group]))
        return out

    def _capture_padded(self, batch: Sequence[Sequence[int]]) -> list[CapturedStates]:
        lengths = [len(ids) for ids in batch]
        if min(lengths) < 1:
            raise ValueError("cannot capture states of an empty sequence")
        b, t_max, h = len(batch), max(lengths), self.hidden_size
        input_ids = torch.full((b, t_max), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((b, t_max), dtype=torch.long)  # (B, T), 1 = real token
        for row, ids in enumerate(batch):
            input_ids[row, : lengths[row]] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, : lengths[row]] = 1
        k = len(self.aux_layer_ids)
        with torch.inference_mode(), shape_stable():
            aux = torch.empty((b, t_max, k * h), dtype=self.output_dtype,
                              device=self.device)  # (B, T, 3H)
            with self._hooks(aux):
                final = self.base(input_ids=input_ids.to(self.device),
                                  attention_mask=attention_mask.to(self.device),
                                  use_cache=False).last_hidden_state  # (B, T, H), post-norm
            final = final.to(self.output_dtype)
        if self.device.type != "cpu":
            aux, final = aux.cpu(), final.cpu()
        return [CapturedStates(aux_hidden=aux[row, :n], final_hidden=final[row, :n])
                for row, n in enumerate(lengths)]  # (T, 3H), (T, H): contiguous views

    @contextlib.contextmanager
    def _hooks(self, aux: torch.Tensor) -> Iterator[None]:
        """Copy each aux layer's output into its slot of ``aux`` as the layer finishes."""
        h = self.hidden_size
        slots: dict[int, list[int]] = {}
        for slot, layer_id in enumerate(self.aux_layer_ids):
            slots.setdefault(layer_id, []).append(slot)
        handles = []
        for layer_id, layer_slots in slots.items():
            def hook(_module: nn.Module, _args: Any, output: Any,
                     layer_slots: list[int] = layer_slots) -> None:
                hidden = output[0] if isinstance(output, tuple) else output  # (B, T, H)
                for slot in layer_slots:
                    aux[..., slot * h:(slot + 1) * h].copy_(hidden)
            handles.append(self.layers[layer_id].register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm) of a causal LM, or the model."""
    base = getattr(model, "model", model)
    if not all(hasattr(base, a) for a in ("layers", "norm")):
        raise TypeError(f"{type(model).__name__}: expected a Llama-style decoder with "
                        "`.model.layers` and `.model.norm`")
    return base


def _budget_groups(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Consecutive indices grouped so that ``len(group) * max(length) <= token_budget``."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


@contextlib.contextmanager
def hf_backend_for_step(storage: Storage, step: int, **kwargs: Any
                        ) -> Iterator[HFCaptureBackend]:
    """The backend over the policy checkpoint that generated ``step``'s rollouts.

    Loads ``policies/step=NNNNNN/`` from the verified dataset cache (every file checked
    against the checkpoint's manifest); ``kwargs`` go to :class:`HFCaptureBackend`.
    """
    local = fetch(storage, policy_prefix(step), kind=POLICY_KIND, label="policy")
    yield HFCaptureBackend(local, **kwargs)
