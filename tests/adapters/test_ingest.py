"""Dump readers and the ingest loop on framework-shaped files.

NeMo-RL and slime cannot run here (GPU engines), so their files are written the way their
writers write them (NeMo-RL: ``json.dumps`` of one dict per sample, padded ``token_ids``
trimmed by ``input_lengths``; slime: ``torch.save({"rollout_id", "samples": [...]})``),
with the demo tokenizer's real ids; the TRL parquet is written with pandas as TRL does.
"""

from __future__ import annotations

import enum
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from dagster import build_sensor_context

from jobs import cli
from jobs.ingest import dump_sensor
from pipeline.adapters.ingest import QUARANTINE, Ingestor
from pipeline.adapters.readers import reader_for
from pipeline.demo import corpus, policy, task
from pipeline.demo.config import DemoConfig
from pipeline.demo.tokenizer import train_tokenizer
from pipeline.layout import raw_prefix
from pipeline.manifest import read_manifest
from pipeline.parquet import read_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.storage import Storage
from pipeline.tokenize import stage as tokenize_stage
from resources.ingest import IngestResource
from resources.storage import StorageResource

PAD = 0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The demo tokenizer and an untrained demo policy saved as the initial policy."""
    root = tmp_path_factory.mktemp("policy")
    config = DemoConfig.small()
    tok = train_tokenizer(vocab_size=config.vocab_size, task_examples=config.tokenizer_examples,
                          filler=config.tokenizer_filler, seed=1)
    policy.save_checkpoint(policy.build_policy(tok, config.model_shape, seed=2), tok,
                           root / "base")
    return tok, root / "base"


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _conversation(tok, n: int, tool: bool):
    """Prompt ids, response ids and the response mask of one (optionally tool-using)
    rollout: assistant tokens 1, the tool turn's tokens 0."""
    problem = task.Problem(n, n + 1, width=2)
    prompt = corpus.encode_prompt(tok, task.prompt_messages(problem))
    answer = _ids(tok, f"{2 * n + 1}") + [tok.eos_token_id]
    if not tool:
        return prompt, answer, [1] * len(answer)
    call = _ids(tok, "call add") + [tok.eos_token_id]
    result = _ids(tok, "<|start_header_id|>tool<|end_header_id|>\n7<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n")
    return prompt, call + result + answer, [1] * len(call) + [0] * len(result) + [1] * len(answer)


def _nemo_file(tok, path: Path, step: int, rows: int = 4) -> list[tuple]:
    """A train_data_step{N}.jsonl as NeMo-RL writes it: padded to the batch max."""
    convs = [_conversation(tok, i + step, tool=i % 2 == 1) for i in range(rows)]
    width = max(len(p) + len(r) for p, r, _ in convs)
    with open(path, "w") as f:  # each value a one-row slice, as BatchedDataDict.slice gives
        for i, (p, r, m) in enumerate(convs):
            ids, mask = p + r, [0] * len(p) + m
            sample = {
                "content": [["What?", "Answer"]], "rewards": [float(i % 2)],
                "input_lengths": [len(ids)], "token_ids": [ids + [PAD] * (width - len(ids))],
                "token_loss_mask": [mask + [0] * (width - len(ids))],
                "sample_loss_mask": [1.0], "advantages": [[0.0] * width]}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
    return convs


def _hf(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)


def _records(storage: Storage, step: int) -> list[dict]:
    manifest = read_manifest(storage, raw_prefix(step))
    return [row for f in manifest.files if f.path.startswith("part")
            for row in read_table(storage, f"{raw_prefix(step)}/{f.path}").to_pylist()]


def _quarantine(storage: Storage, step: int) -> list[dict]:
    return read_table(storage, f"{raw_prefix(step)}/quarantine.parquet").to_pylist()


def test_nemo_rl_steps_keep_exact_ids_tool_masks_and_the_generating_checkpoint(world, tmp_path):
    tok, base = world
    dump, ckpts = tmp_path / "logs", tmp_path / "results"
    dump.mkdir()
    convs = {n: _nemo_file(tok, dump / f"train_data_step{n}.jsonl", n) for n in (1, 2, 3)}
    _hf(base, ckpts / "step_2" / "policy" / "weights")  # saved every 2 steps
    storage = Storage((tmp_path / "store").as_uri())
    ingestor = Ingestor(storage, reader_for("nemo-rl"), dump, base, checkpoints=ckpts,
                        sampling={"temperature": 1.0}, settle_s=0)
    report = ingestor.run_once()
    assert [s.step for s in report.written] == [1, 2, 3] and not report.quarantined
    for step, rows in convs.items():
        records = _records(storage, step)
        for rec, (prompt, response, mask) in zip(records, rows, strict=True):
            assert (rec["prompt_token_ids"], rec["response_token_ids"],
                    rec["response_loss_mask"]) == (prompt, response, mask)
            assert (rec["trainer_step"], rec["generated_by_policy_version"]) == (step, step - 1)
            assert rec["token_fidelity"] == "exact"
        # the file of step N was generated by policy N-1: step 3 publishes step_2, steps 1
        # and 2 (policies 0 and 1, the latter never saved) the initial policy
        assert read_manifest(storage, raw_prefix(step)).meta["policy_version"] == \
            {1: 0, 2: 0, 3: 2}[step]
    assert ingestor.run_once().written == []  # committed steps are never rewritten

    # through the data path: the tool turn's tokens stay out of the loss
    snapshot_stage.run(storage, 3)
    tokenize_stage.run(storage, 3)
    from pipeline.layout import tokenized_prefix
    manifest = read_manifest(storage, tokenized_prefix(3))
    rows = [r for f in manifest.files
            for r in read_table(storage, f"{tokenized_prefix(3)}/{f.path}").to_pylist()]
    prompt, response, mask = convs[3][1]
    tool_row = next(r for r in rows if r["input_ids"] == prompt + response)
    assert [int(x) for x in tool_row["loss_mask"]] == [0] * len(prompt) + mask


def test_a_bad_nemo_row_quarantines_its_file_with_the_reason_until_it_is_fixed(world, tmp_path):
    tok, base = world
    dump = tmp_path / "logs"
    dump.mkdir()
    _nemo_file(tok, dump / "train_data_step1.jsonl", 1)
    bad = dump / "train_data_step2.jsonl"
    _nemo_file(tok, bad, 2)
    lines = bad.read_text().splitlines()
    broken = json.loads(lines[1]) | {"input_lengths": [10_000]}
    bad.write_text("\n".join([lines[0], json.dumps(broken), *lines[2:]]) + "\n")
    storage = Storage((tmp_path / "store").as_uri())
    ingestor = Ingestor(storage, reader_for("nemo-rl"), dump, base, settle_s=0)
    first = ingestor.run_once()
    assert [s.step for s in first.written] == [1]
    assert first.quarantined == {"train_data_step2.jsonl": "line 2.input_lengths: 10000 but "
                                 f"{len(broken['token_ids'][0])} token ids and "
                                 f"{len(broken['token_loss_mask'][0])} mask entries"}
    kept = json.loads(storage.read_bytes(f"{QUARANTINE}/nemo-rl/train_data_step2.jsonl"
                                         ".reason.json"))
    assert kept["field"] == "line 2.input_lengths"
    assert storage.read_bytes(f"{QUARANTINE}/nemo-rl/train_data_step2.jsonl") == \
        bad.read_bytes()
    assert ingestor.run_once().quarantined == first.quarantined  # reported again, not skipped
    _nemo_file(tok, bad, 2)  # the framework rewrites it
    assert [s.step for s in ingestor.run_once().written] == [2]


class _Status(enum.Enum):
    COMPLETED = "completed"


def _slime_sample(tok, i: int, tool: bool) -> dict:
    prompt, response, mask = _conversation(tok, i, tool)
    return {"group_index": i // 2, "index": i, "prompt": "What is it?",
            "tokens": prompt + response, "response": "...", "response_length": len(response),
            "loss_mask": mask, "reward": float(i), "weight_versions": ["4", "5"],
            "status": "completed", "rollout_log_probs": [-0.5] * len(response),
            "spec_info": {"spec_accept_token_num": 3, "spec_draft_token_num": 6,
                          "spec_verify_ct": 2, "completion_token_num": len(response)},
            "metadata": {}}


def test_slime_files_load_as_plain_data_and_anything_else_is_refused(world, tmp_path):
    tok, base = world
    dump = tmp_path / "debug"
    dump.mkdir()
    samples = [_slime_sample(tok, i, tool=i == 1) for i in range(3)]
    torch.save({"rollout_id": 5, "samples": samples}, dump / "rollout_5.pt")
    # an object a weights-only load refuses (a full unpickle would import and build it)
    torch.save({"rollout_id": 6, "samples": [samples[0] | {"status": _Status.COMPLETED}]},
               dump / "rollout_6.pt")
    (dump / "rollout_7.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    _hf(base, tmp_path / "hf" / "2")  # --save-hf hf/{rollout_id}: after 3 steps, rollout 2
    storage = Storage((tmp_path / "store").as_uri())
    report = Ingestor(storage, reader_for("slime"), dump, base, checkpoints=tmp_path / "hf",
                      settle_s=0).run_once()
    assert [s.step for s in report.written] == [5]
    assert read_manifest(storage, raw_prefix(5)).meta["policy_version"] == 3
    assert report.quarantined["rollout_6.pt"].startswith("<file>: needs a full unpickle")
    assert report.quarantined["rollout_7.pt"].startswith("<file>: not a torch.save file")
    records = _records(storage, 5)
    for rec, sample in zip(records, samples, strict=True):
        n = sample["response_length"]
        assert rec["response_token_ids"] == sample["tokens"][-n:]
        assert rec["prompt_token_ids"] == sample["tokens"][:-n]
        assert rec["response_loss_mask"] == sample["loss_mask"]
        # the oldest weight version, 4, is the policy after 3 steps (slime updates once
        # before rollout 0)
        assert rec["generated_by_policy_version"] == 3
        assert rec["finish_reason"] == "stop"
    assert 0 in records[1]["response_loss_mask"]


def test_text_dumps_are_retokenized_and_multi_turn_text_is_quarantined(world, tmp_path):
    tok, base = world
    out = tmp_path / "trl-out"
    (out / "completions").mkdir(parents=True)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    pd.DataFrame({
        "step": [4, 4], "prompt": [prompt, prompt],
        "completion": [[{"role": "assistant", "content": "5"}],
                       [{"role": "assistant", "content": "call"},
                        {"role": "tool", "content": "5"},
                        {"role": "assistant", "content": "5"}]],
        "accuracy": [1.0, 1.0], "brevity": [-0.1, -0.3], "advantage": [0.5, -0.5],
    }).to_parquet(out / "completions" / "completions_00004.parquet")
    _hf(base, out / "checkpoint-3")
    storage = Storage((tmp_path / "store").as_uri())
    reader = reader_for("trl-text")
    reader.reward_columns = {"accuracy": 1.0, "brevity": 0.5}
    report = Ingestor(storage, reader, out / "completions", base, settle_s=0).run_once()
    assert [s.step for s in report.written] == [4]
    (rec,) = _records(storage, 4)
    assert rec["token_fidelity"] == "retokenized" and rec["prompt_token_ids"] is None
    assert rec["messages"] == prompt + [{"role": "assistant", "content": "5"}]
    assert rec["reward"] == pytest.approx(0.95)
    assert read_manifest(storage, raw_prefix(4)).meta["policy_version"] == 3
    (refused,) = _quarantine(storage, 4)
    assert (refused["stage"], refused["field"]) == ("writer", "messages")
    assert refused["reason"].startswith("multi-turn text")

    verl = tmp_path / "rollouts"
    verl.mkdir()
    rows = [{"input": "user\nWhat is 2 + 3?\nassistant\n", "output": "5", "score": 1.0,
             "step": 2, "uid": "a"},
            {"input": "user\nWhat?\nassistant\n", "output": "call\ntool\n5\n5", "score": 0.0,
             "step": 2, "uid": "b"}]
    (verl / "2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Ingestor(storage, reader_for("verl-text"), verl, base, settle_s=0,
             allow_multi_turn_text=True).run_once()
    records = _records(storage, 2)
    assert [r["response_token_ids"] for r in records] == [_ids(tok, "5"),
                                                          _ids(tok, "call\ntool\n5\n5")]
    assert {r["token_fidelity"] for r in records} == {"retokenized"}
    assert [r["generated_by_policy_version"] for r in records] == [1, 1]


def test_the_newest_file_waits_until_it_settles(world, tmp_path):
    tok, base = world
    dump = tmp_path / "logs"
    dump.mkdir()
    for n in (1, 2):
        _nemo_file(tok, dump / f"train_data_step{n}.jsonl", n)
    storage = Storage((tmp_path / "store").as_uri())
    report = Ingestor(storage, reader_for("nemo-rl"), dump, base, settle_s=3600).run_once()
    assert [s.step for s in report.written] == [1]
    assert report.waiting == ["train_data_step2.jsonl"]


def test_the_cli_and_the_sensor_follow_a_dump_directory(world, tmp_path, monkeypatch, capsys):
    tok, base = world
    dump = tmp_path / "logs"
    dump.mkdir()
    _nemo_file(tok, dump / "train_data_step1.jsonl", 1)
    storage_url = (tmp_path / "store").as_uri()
    monkeypatch.setenv("AERIE_STORAGE_URL", storage_url)
    settings = IngestResource(framework="nemo-rl", directory=str(dump),
                              initial_policy=str(base), settle_s=0)
    resources = {"storage": StorageResource(url=storage_url), "ingest": settings}
    with build_sensor_context(resources=resources) as context:
        assert dump_sensor(context).run_key  # step 1 is not committed yet
    assert cli.main(["ingest", "nemo-rl", str(dump), "--initial-policy", str(base),
                     "--settle", "0", "--sampling", '{"temperature": 0.7}']) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["written"] == [1]
    storage = Storage(storage_url)
    assert read_manifest(storage, raw_prefix(1)).meta["sampling"]["temperature"] == 0.7
    with build_sensor_context(resources=resources) as context:
        assert "committed" in dump_sensor(context).skip_message
    off = {"storage": StorageResource(url=storage_url), "ingest": IngestResource()}
    with build_sensor_context(resources=off) as context:
        assert "no dump directory configured" in dump_sensor(context).skip_message


def test_the_ingest_job_runs_from_the_definitions(world, tmp_path):
    from dagster import instance_for_test

    from definitions import defs
    tok, base = world
    dump = tmp_path / "logs"
    dump.mkdir()
    _nemo_file(tok, dump / "train_data_step1.jsonl", 1)
    storage_url = (tmp_path / "store").as_uri()
    job = defs.get_job_def("ingest_dumps")
    with instance_for_test() as instance:
        result = job.execute_in_process(instance=instance, resources={
            "storage": StorageResource(url=storage_url),
            "ingest": IngestResource(framework="nemo-rl", directory=str(dump),
                                     initial_policy=str(base), settle_s=0)})
    assert result.success
    assert result.output_for_node("ingest_dump_files")["written"] == [1]
