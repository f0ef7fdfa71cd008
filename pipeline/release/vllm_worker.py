"""Aerie's vLLM worker extension: load EAGLE-3 draft weights from a directory in place.

vLLM (0.33) updates draft weights at runtime only as tensors streamed from a trainer
(``/start_draft_weight_update`` + ``/update_weights`` over NCCL or CUDA IPC); it has no
route that loads a draft model from files. What it does have: a worker extension class
(``--worker-extension-cls``, mixed into every GPU worker) whose methods the dev-mode route
``POST /collective_rpc {"method": ..., "kwargs": ...}`` calls on every worker. This class
adds :meth:`aerie_load_draft_weights`: it reads the drafter's ``model.safetensors`` and
hands the tensors to the running drafter's own ``load_weights`` (vLLM's EAGLE-3 loader maps
Aerie's SGLang-form names: ``midlayer.`` to ``layers.0.``, ``d2t`` to
``draft_id_to_target_id``, ``t2d`` skipped), which copies them into the parameters the
engine's CUDA graphs already point at.

Launch vLLM with ``VLLM_SERVER_DEV_MODE=1`` and
``--worker-extension-cls pipeline.release.vllm_worker.AerieDraftLoader``; this module
imports nothing beyond torch and safetensors, so it loads inside the vLLM process.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

METHOD = "aerie_load_draft_weights"
PROBE = "aerie_draft_loader"  # answers {"loader": VERSION, "drafter": bool}: extension there?
VERSION = 1
EXTENSION = f"{__name__}.AerieDraftLoader"
WEIGHTS = "model.safetensors"  # pipeline.eagle3.export.WEIGHTS_NAME, without its imports


class AerieDraftLoader:
    """Mixed into vLLM's GPU worker: ``self.model_runner.drafter.model`` is the drafter."""

    def aerie_draft_loader(self, require_drafter: bool = False) -> dict[str, int | bool]:
        """That the extension is loaded, and whether this worker runs a drafter (an error
        without one if ``require_drafter``: for callers that do not see the result)."""
        has = self._aerie_drafter() is not None
        if require_drafter and not has:
            raise RuntimeError("this vLLM worker runs no EAGLE drafter")
        return {"loader": VERSION, "drafter": has}

    def _aerie_drafter(self):
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        model = getattr(drafter, "model", None)
        return model if hasattr(model, "load_weights") else None

    def aerie_load_draft_weights(self, path: str) -> dict[str, int]:
        """Load ``path/model.safetensors`` into the running EAGLE-3 drafter; the number of
        tensors read, for the caller to check every worker took the whole drafter."""
        model = self._aerie_drafter()
        if model is None:
            raise RuntimeError("this vLLM worker runs no EAGLE drafter: start it with "
                               "--speculative-config '{\"method\": \"eagle3\", ...}'")
        weights = load_file(str(Path(path) / WEIGHTS), device="cpu")
        model.load_weights(iter(weights.items()))
        return {"tensors": len(weights)}
