"""The demo's export through vLLM speculators' converter and loader, and the check's
teeth: an export naming one layer twice (what the demo wrote before its ids were checked)
is refused by speculators itself."""

from __future__ import annotations

import json

import pytest

from pipeline.demo.config import DemoConfig
from pipeline.demo.policy import build_policy
from pipeline.eagle3.config import DrafterConfig
from pipeline.eagle3.export import save_drafter
from pipeline.eagle3.model import Eagle3Drafter
from tests.tokenize.chat_tokenizers import demo_tokenizer

pytestmark = pytest.mark.integration


def demo_export(tmp_path):
    """The demo world's target and the drafter export the training stage writes for it
    (same config derivation, same writer; weights random)."""
    policy = build_policy(demo_tokenizer(), DemoConfig().model_shape, seed=0)
    policy.save_pretrained(tmp_path / "policy")
    config = DrafterConfig.from_target(policy.config, draft_vocab_size=64)
    drafter = Eagle3Drafter(config, policy.get_input_embeddings().weight.detach())
    return save_drafter(drafter, config, tmp_path / "drafter"), tmp_path / "policy"


def test_the_demo_export_loads_in_vllm_speculators(speculators, tmp_path):
    drafter, target = demo_export(tmp_path)
    report, error = speculators.load(drafter, target, tmp_path / "out")
    assert report is not None, error
    assert report["missing"] == [] and report["differing"] == []
    assert report["current_missing"] == [] and report["current_differing"] == []
    assert report["layer_ids"] == report["current_layer_ids"] == [1, 2, 3]  # demo layers 0-2


def test_duplicate_layer_ids_are_refused_by_speculators(speculators, tmp_path):
    drafter, target = demo_export(tmp_path)
    config = json.loads((drafter / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 1, 0]
    config["eagle_aux_hidden_state_layer_ids"] = [2, 2, 1]  # the demo's old export
    (drafter / "config.json").write_text(json.dumps(config))
    report, error = speculators.load(drafter, target, tmp_path / "out")
    assert report is None and "target_layer_ids must be distinct" in error
