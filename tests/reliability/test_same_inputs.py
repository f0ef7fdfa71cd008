"""Same inputs, same fingerprint: a small loop run twice, each time in a fresh home.

Snapshot → tokenize → capture → vocab → a drafter from scratch (step 2) → a drafter warm
started from it (step 3) → the acceptance report of step 3 against step 2, through the
stages' own ``run`` functions, in two homes. Every fingerprint and every committed file must
be the same in both; the only fields allowed to differ are the measurements named in
:data:`MEASUREMENTS` (wall-clock timings, recorded as such).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.capture import stage as capture_stage
from pipeline.capture.config import ExtractConfig
from pipeline.capture.hf import HFCaptureBackend
from pipeline.demo import tokenizer as demo_tokenizer
from pipeline.demo.policy import save_checkpoint
from pipeline.evaluation import stage as evaluation_stage
from pipeline.evaluation.config import EvalConfig
from pipeline.layout import drafter_prefix, eval_prefix, shards_prefix
from pipeline.manifest import read_manifest
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.policy import load_policy_ref
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage
from pipeline.tokenize import stage as tokenize_stage
from pipeline.tokenize.chat_masks import encode_chat
from pipeline.training import stage as training_stage
from pipeline.training.config import TrainConfig
from pipeline.vocab import stage as vocab_stage
from tests.families import tiny_llama

pytestmark = pytest.mark.integration

STEPS = (1, 2, 3)
EXTRACT = ExtractConfig(token_budget=512, max_batch_size=8, shard_bytes=1 << 16,
                        heldout_fraction=0.25)
TRAIN = TrainConfig(lr=1e-3, micro_batch_size=4, epochs=1, max_steps=4, ttt_depth=2,
                    threads=1, zero_stage=0, log_every=1, export_dtype="float32")
EVAL = EvalConfig(max_prompts=3, max_new_tokens=8, num_steps=2, eagle_topk=1,
                  num_draft_tokens=3, reference_prompts=1)
# the wall-clock timings the records keep as measurements (drafter manifests, eval reports)
MEASUREMENTS = {"seconds", "tokens_per_s", "samples_per_s", "prefill_seconds",
                "draft_seconds", "verify_seconds"}


def conversations(step: int, n: int = 24) -> list[list[dict]]:
    return [[{"role": "user", "content": f"what is {i} plus {step}?"},
             {"role": "assistant", "content": f"{i} plus {step} is {i + step}."}]
            for i in range(n)]


def small_loop(home: Path) -> Storage:
    """The loop of the module docstring in ``home``; its storage."""
    torch.manual_seed(0)
    tokenizer = demo_tokenizer.train_tokenizer(vocab_size=384, task_examples=100, filler=200)
    policy = tiny_llama(0, vocab=len(tokenizer), hidden=32, layers=4, intermediate=64,
                        max_positions=256)
    policy_dir = home / "policy"
    save_checkpoint(policy, tokenizer, policy_dir)
    storage = Storage((home / "storage").as_uri())
    backend = HFCaptureBackend(policy, token_budget=EXTRACT.token_budget)
    for step in STEPS:
        records = []
        for i, messages in enumerate(conversations(step)):
            ids, mask = encode_chat(tokenizer, messages)
            first, end = mask.index(1), len(mask) - mask[::-1].index(1)
            records.append({"rollout_id": f"r{step}-{i}", "trainer_step": step,
                            "generated_by_policy_version": step, "messages": messages,
                            "prompt_token_ids": ids[:first],
                            "response_token_ids": ids[first:end], "reward": 1.0,
                            "finish_reason": "stop", "token_fidelity": "exact"})
        SnapshotWriter(storage).write_step(step, records, policy_dir, step)
        snapshot_stage.run(storage, step)
        tokenize_stage.run(storage, step)
        capture_stage.run(storage, step, backend, EXTRACT,
                          policy=load_policy_ref(storage, step))
    work = home / "training"
    for step in STEPS[1:]:
        vocab_stage.run(storage, step, 2, 64)
        training_stage.run(storage, step, TRAIN, work_root=work, warm_start="previous")
    evaluation_stage.run(storage, 3, drafter_prefix(3), drafter_prefix(2), EVAL)
    return storage


def committed(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def without_measurements(path: str, data: bytes) -> object:
    """A JSON file as data, less the timings it records; a manifest also less the sha256 and
    size of the JSON files it lists (compared themselves, the same way). Other files: bytes."""
    if not path.endswith(".json"):
        return data

    def strip(value: object) -> object:
        if isinstance(value, dict):
            for name in MEASUREMENTS & value.keys():
                assert isinstance(value[name], float), (path, name, value[name])
            return {k: strip(v) for k, v in value.items() if k not in MEASUREMENTS}
        return [strip(v) for v in value] if isinstance(value, list) else value

    record = strip(json.loads(data))
    if path.endswith("_manifest.json"):
        record["files"] = [{k: v for k, v in f.items() if k not in ("sha256", "bytes")}
                           if f["path"].endswith(".json") else f for f in record["files"]]
    return record


def fingerprints(storage: Storage) -> dict[str, str]:
    found = {}
    for prefix in (drafter_prefix(2), drafter_prefix(3), eval_prefix(3),
                   *map(shards_prefix, STEPS)):
        found[prefix] = read_manifest(storage, prefix).meta["fingerprint"]
    return found


def test_a_loop_run_twice_in_two_homes_gives_the_same_fingerprints_and_bytes(tmp_path):
    first = small_loop(tmp_path / "one")
    second = small_loop(tmp_path / "two")

    a, b = fingerprints(first), fingerprints(second)
    assert a == b
    warm = read_manifest(first, drafter_prefix(3)).meta["warm_start"]
    assert warm["mode"] == "warm" and "drafters/step=000002" in warm["source"]

    one, two = committed(tmp_path / "one" / "storage"), committed(tmp_path / "two" / "storage")
    assert sorted(one) == sorted(two)  # same layout, vocab cache keys included
    differ = [p for p in one if without_measurements(p, one[p]) != without_measurements(
        p, two[p])]
    assert differ == []
