"""Load an Aerie drafter export the way vLLM's speculators project does (run by the tests of
``tests/matrix/`` inside a separate environment with speculators installed; it imports
nothing from Aerie).

A small service: each line on stdin is a JSON request ``{"drafter", "target", "out"}`` (one
process serves the whole session, so speculators is imported once, as it starts: before the
first request comes); each answer is one line
on stdout, ``SPECULATORS-REPORT <json>``, the report or ``{"error": <traceback tail>}``.
For a request, it converts the export with
speculators' own EAGLE-3 converter (the path a vLLM user takes from an SGLang-format
drafter), passing the layer ids the export writes for vLLM (top-level
``eagle_aux_hidden_state_layer_ids``), lets the converter validate the result against the
target after speculators' own layer-id check (distinct, within the target's depth), loads
the result with the converter's model and, for drafters of the target's width, with
speculators' current model, and prints a JSON report: the converted config, and every
exported tensor a loaded model lacks or holds with other values.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.convert.eagle.eagle3_legacy_model import Eagle3Speculator
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.utils import resolve_target_layer_ids


def _compare(ours: dict, state: dict) -> tuple[list[str], list[str]]:
    """Exported tensors the loaded model lacks, and those it holds with other values."""
    missing, differing = [], []
    for name, tensor in ours.items():
        theirs = state.get(name.replace("midlayer.", "layers.0."))
        if theirs is None:
            missing.append(name)
        elif theirs.shape != tensor.shape or not torch.equal(theirs.to(tensor.dtype), tensor):
            differing.append(name)
    return missing, differing


def main(drafter: Path, target: Path, out: Path) -> dict:
    written = json.loads((drafter / "config.json").read_text())
    ids = written["eagle_aux_hidden_state_layer_ids"]
    resolve_target_layer_ids(ids, str(target))  # distinct and within the target's depth
    Eagle3Converter().convert(drafter, out, base_model=str(target), validate=True,
                              eagle_aux_hidden_state_layer_ids=ids)
    ours = load_file(str(drafter / "model.safetensors"))
    legacy = Eagle3Speculator.from_pretrained(
        str(out), verifier=str(target), verifier_attachment_mode="detached",
        has_drafter_embedding="embed_tokens.weight" in ours)
    missing, differing = _compare(ours, legacy.state_dict())
    converted = json.loads((out / "config.json").read_text())
    layer = converted["transformer_layer_config"]
    report = {"missing": missing, "differing": differing, "layer_ids": ids,
              "target_hidden_size": converted.get("target_hidden_size"),
              "draft_vocab_size": converted.get("draft_vocab_size"),
              "hidden_size": layer["hidden_size"], "head_dim": layer.get("head_dim"),
              "rope_theta": layer.get("rope_theta", (layer.get("rope_parameters") or {}).get(
                  "rope_theta")),
              "rope_type": (layer.get("rope_parameters") or layer.get("rope_scaling")
                            or {}).get("rope_type", "default")}
    # speculators' current model sizes fc from hidden_size (it ignores target_hidden_size),
    # so it loads only drafters of the target's width; vLLM's own EAGLE-3 model reads
    # target_hidden_size, as the converter's model above does
    if "embed_tokens.weight" not in ours:
        current = Eagle3DraftModel.from_pretrained(str(out))
        report["current_layer_ids"] = current.config.eagle_aux_hidden_state_layer_ids
        report["current_missing"], report["current_differing"] = _compare(
            ours, current.state_dict())
    return report


def serve() -> None:
    import traceback

    for line in sys.stdin:
        request = json.loads(line)
        try:
            report = main(*(Path(request[k]) for k in ("drafter", "target", "out")))
        except Exception:  # noqa: BLE001 - the refusal is the answer, reported to the test
            report = {"error": traceback.format_exc()[-3000:]}
        print("SPECULATORS-REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    serve()
