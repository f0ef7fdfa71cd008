"""Tokenization stage: exact ids, truncation window, counts, tokenize.stage.run and the asset."""

from __future__ import annotations

import dataclasses
import json

import pytest
from dagster import AssetKey, instance_for_test, materialize

from assets.tokenized import TokenizeRunConfig, tokenized_rollouts
from pipeline.layout import policy_prefix, tokenized_prefix
from pipeline.manifest import read_manifest, verify_manifest
from pipeline.parquet import read_table
from pipeline.snapshot import stage as snapshot_stage
from pipeline.snapshot.policy import load_policy_ref, publish_policy
from pipeline.snapshot.sieve import SnapshotError
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage
from pipeline.tokenize import stage as tokenize_stage
from pipeline.tokenize.chat_masks import (
    ChatMaskError,
    check_offsets,
    encode_chat,
    encode_prompt,
    mask_from_offsets,
)
from pipeline.tokenize.config import TokenizeConfig
from pipeline.tokenize.schema import TOKENIZED_KIND, TOKENIZED_SCHEMA
from pipeline.tokenize.stage import first_difference, load_step_tokenizer, tokenize_record, truncate
from resources.storage import StorageResource
from tests.tokenize.chat_tokenizers import (
    TOKENIZERS,
    chatml_think_tokenizer,
    chatml_tokenizer,
    demo_tokenizer,
)

CHAT = [{"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "The answer is 5."}]


def exact_record(tokenizer, rid: str, messages=CHAT, **extra) -> dict:
    """An 'exact' record whose ids are what the chat template gives (the engine's view)."""
    ids, mask = encode_chat(tokenizer, messages)
    first = mask.index(1)
    last = len(mask) - mask[::-1].index(1)
    return {"rollout_id": rid, "trainer_step": 2, "generated_by_policy_version": 1,
            "messages": messages, "prompt_token_ids": ids[:first],
            "response_token_ids": ids[first:last], "token_fidelity": "exact", **extra}


def text_record(rid: str, messages=CHAT) -> dict:
    return {"rollout_id": rid, "trainer_step": 2, "generated_by_policy_version": 1,
            "messages": messages, "token_fidelity": "retokenized"}


# -- masking primitives -------------------------------------------------------------------
def test_a_token_is_masked_iff_it_overlaps_a_span():
    spans = [(3, 6), (10, 12)]
    offsets = [(0, 3), (2, 4), (4, 6), (6, 7), (7, 10), (9, 11), (11, 11), (12, 12), (12, 15)]
    #          before   straddle  inside  after   touches  straddle  0-width  0-width  after
    assert mask_from_offsets(offsets, spans) == [0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert mask_from_offsets(offsets, []) == [0] * len(offsets)


def test_offsets_with_gaps_are_refused():
    check_offsets("abcd", [(0, 2), (2, 2), (1, 2), (2, 4)])  # tiles: fine
    for bad in ([(0, 2), (3, 4)], [(1, 4)], [(0, 3)], []):
        with pytest.raises(ChatMaskError, match="exact offsets"):
            check_offsets("abcd", bad)


# -- exact ids ----------------------------------------------------------------------------
def test_exact_ids_are_the_truth_and_agree_with_the_template():
    tok = chatml_tokenizer()
    rec = exact_record(tok, "a")
    r = tokenize_record(tok, rec)
    assert r.source == "exact" and r.checked and r.mismatch is None and r.dropped is None
    assert r.input_ids == rec["prompt_token_ids"] + rec["response_token_ids"]
    assert r.loss_mask == [0] * len(rec["prompt_token_ids"]) + [1] * len(
        rec["response_token_ids"])
    assert tok.decode(rec["response_token_ids"]) == "The answer is 5.<|im_end|>"


THINKING = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "<think>\nAdd two and three.\n</think>\n\n5."}]


@pytest.mark.parametrize("template", ["qwen3", "gpt_oss"])
def test_reasoning_sent_as_text_is_kept_and_trained_like_exact_ids(template):
    """A thinking model's rollout as text (reasoning inline) is tokenized as the template
    renders it, reasoning included, and equals the record of the engine's own ids (the
    template's generation prompt + what the policy wrote): neither is dropped."""
    tok = TOKENIZERS[template]()
    text = tokenize_record(tok, text_record("t", THINKING))
    assert text.source == "chat_template" and text.dropped is None
    exact = tokenize_record(tok, exact_record(tok, "e", THINKING))
    assert exact.checked and exact.mismatch is None and exact.dropped is None
    n = len(exact.input_ids)  # the text record also keeps the template's trailing glue
    assert (text.input_ids[:n], text.loss_mask[:n]) == (exact.input_ids, exact.loss_mask)
    assert not any(text.loss_mask[n:])
    trained = tok.decode([t for t, m in zip(text.input_ids, text.loss_mask, strict=True)
                          if m])
    assert "Add two and three." in trained and trained.endswith(
        "5.<|im_end|>" if template == "qwen3" else "5.<|return|>")
    prompt = encode_prompt(tok, THINKING[:1])
    assert text.input_ids[:len(prompt)] == prompt and not any(text.loss_mask[:len(prompt)])


def test_a_mismatching_exact_record_is_counted_and_its_ids_kept():
    tok = chatml_tokenizer()
    rec = exact_record(tok, "b")
    # The engine sampled a non-canonical split of "answer" (same text, other ids).
    pieces = [tok.convert_tokens_to_ids(c) for c in "answer"]
    canonical = rec["response_token_ids"]
    pos = next(i for i, t in enumerate(canonical) if "answer" in tok.convert_ids_to_tokens(t))
    response = canonical[:pos] + [tok.convert_tokens_to_ids("Ġ")] + pieces + canonical[pos + 1:]
    assert tok.decode(response) == tok.decode(canonical)
    rec = {**rec, "response_token_ids": response, "response_loss_mask": [1] * len(response)}
    r = tokenize_record(tok, rec)
    assert r.input_ids == rec["prompt_token_ids"] + response  # kept as given, not "fixed"
    prompt_len = len(rec["prompt_token_ids"])
    assert r.mismatch is not None and r.mismatch.position == prompt_len + pos
    assert r.mismatch.exact_token == "Ġ" and "answer" in r.mismatch.retokenized_token
    assert first_difference(r.input_ids, r.input_ids) is None


def test_response_loss_mask_zeroes_tool_tokens_and_prompt_only_messages_are_compared():
    tok = chatml_tokenizer()
    prompt = encode_prompt(tok, CHAT[:1])
    response = tok("5 and done<|im_end|>", add_special_tokens=False)["input_ids"]
    loss = [1] * len(response)
    loss[1:3] = [0, 0]
    rec = {**text_record("c", CHAT[:1]), "token_fidelity": "exact", "prompt_token_ids": prompt,
           "response_token_ids": response, "response_loss_mask": loss}
    r = tokenize_record(tok, rec)
    assert r.loss_mask == [0] * len(prompt) + loss and r.checked and r.mismatch is None
    other = tok.convert_tokens_to_ids("Ġ")
    bad = tokenize_record(tok, {**rec, "prompt_token_ids": prompt[:-1] + [other]})
    assert bad.mismatch.position == len(prompt) - 1 and bad.mismatch.exact_token == "Ġ"
    assert bad.input_ids[len(prompt) - 1] == other
    short = tokenize_record(tok, {**rec, "prompt_token_ids": prompt[:-1]})
    assert short.mismatch.position == len(prompt) - 1 and short.mismatch.exact_token is None


def test_ids_without_an_assistant_message_use_the_generation_prompt():
    tok = chatml_think_tokenizer()
    response = tok("5<|im_end|>", add_special_tokens=False)["input_ids"]
    r = tokenize_record(tok, {**text_record("d", CHAT[:1]), "response_token_ids": response})
    assert r.source == "given_ids"
    assert tok.decode(r.input_ids).endswith("assistant\n<think>\n\n</think>\n\n5<|im_end|>")
    assert r.loss_mask == [0] * (len(r.input_ids) - len(response)) + [1] * len(response)


# -- truncation ---------------------------------------------------------------------------
def test_short_samples_are_untouched():
    assert truncate([1, 2, 3], [0, 1, 1], 1, TokenizeConfig(max_length=3, keep_tail=2)) == (
        [1, 2, 3], [0, 1, 1], False)


def test_cut_keeps_the_prompt_head_and_the_end_of_the_response():
    ids = list(range(100))
    mask = [0] * 10 + [1] * 85 + [0] * 5  # prompt 10, response 85, trailing glue 5
    cfg = TokenizeConfig(max_length=40, keep_tail=16)
    out, out_mask, cut = truncate(ids, mask, 10, cfg)
    assert cut and len(out) == 40
    assert out[:10] == list(range(10))  # whole prompt: it fits next to the tail
    assert out[10:] == list(range(65, 95))  # the last 30 response tokens, glue dropped
    assert out_mask == [0] * 10 + [1] * 30


def test_a_long_prompt_yields_to_the_response_tail():
    ids = list(range(200))
    mask = [0] * 150 + [1] * 50
    out, out_mask, _ = truncate(ids, mask, 150, TokenizeConfig(max_length=64, keep_tail=24))
    assert out == list(range(40)) + list(range(176, 200))  # head 64-24, last 24 response
    assert out_mask == [0] * 40 + [1] * 24
    out, out_mask, _ = truncate(ids, mask, 150, TokenizeConfig(max_length=64, keep_tail=64))
    assert out == list(range(136, 200))  # keep_tail = max_length: simply the last tokens
    assert sum(out_mask) == 50


def test_only_trailing_glue_is_dropped_when_the_response_end_fits():
    out, out_mask, cut = truncate(list(range(12)), [0, 0] + [1] * 8 + [0, 0], 2,
                                  TokenizeConfig(max_length=10, keep_tail=4))
    assert cut and out == list(range(10)) and sum(out_mask) == 8


def test_config_is_validated_and_keep_tail_capped_at_max_length():
    with pytest.raises(ValueError, match="keep_tail"):
        TokenizeConfig(max_length=16, keep_tail=0)
    ids, mask = list(range(30)), [0] * 20 + [1] * 10
    assert truncate(ids, mask, 20, TokenizeConfig(max_length=8, keep_tail=512))[0] == list(
        range(22, 30))
    with pytest.raises(ValueError, match="max_length"):
        TokenizeConfig(max_length=1, keep_tail=1)


def test_truncated_and_dropped_records_are_reported():
    tok = chatml_tokenizer()
    long_chat = [CHAT[0], {"role": "assistant", "content": "The answer is 5. " * 20}]
    cfg = TokenizeConfig(max_length=48, keep_tail=24, min_response_tokens=3)
    r = tokenize_record(tok, text_record("long", long_chat), cfg)
    assert r.truncated and len(r.input_ids) == 48
    assert tok.decode(r.input_ids).endswith("The answer is 5. <|im_end|>")
    assert r.loss_mask[-1] == 1 and r.dropped is None
    tiny = exact_record(tok, "tiny", [CHAT[0], {"role": "assistant", "content": "5"}])
    assert tokenize_record(tok, tiny, cfg).dropped == "too_few_masked_tokens"
    silent = {**exact_record(tok, "zero"), "response_loss_mask": None}
    silent["response_loss_mask"] = [0] * len(silent["response_token_ids"])
    assert tokenize_record(tok, silent, cfg).dropped == "no_masked_tokens"


# -- the stage, end to end ------------------------------------------------------------------
def write_policy(tmp_path, tokenizer):
    policy = tmp_path / "policy"
    tokenizer.save_pretrained(policy)
    (policy / "config.json").write_text(json.dumps({"vocab_size": len(tokenizer)}))
    (policy / "model.safetensors").write_bytes(b"\0" * 64)
    return policy


def step_records(tok, n: int = 7) -> list[dict]:
    recs = [exact_record(tok, f"e{i}", [CHAT[0], {"role": "assistant",
                                                 "content": f"It is {i} + 5."}])
            for i in range(n)]
    recs[1] = {**recs[1], "response_token_ids": recs[1]["response_token_ids"][::-1]}  # mismatch
    recs += [text_record("t0"), text_record("t-long", [
        CHAT[0], {"role": "assistant", "content": "The answer is 5. " * 40}])]
    recs.append({**exact_record(tok, "z"), "response_loss_mask": None})
    recs[-1]["response_loss_mask"] = [0] * len(recs[-1]["response_token_ids"])
    return [{**r, "trainer_step": 2} for r in recs]


@pytest.fixture
def snapshot(tmp_path):
    storage = Storage((tmp_path / "storage").as_uri())
    tok = chatml_tokenizer()
    SnapshotWriter(storage).write_step(2, step_records(tok), write_policy(tmp_path, tok), 1)
    snapshot_stage.run(storage, 2)
    return storage


def test_the_step_tokenizer_round_trips_through_storage(snapshot):
    tok, ref = load_step_tokenizer(snapshot, 2)
    assert tok.chat_template == chatml_tokenizer().chat_template
    assert encode_chat(tok, CHAT) == encode_chat(chatml_tokenizer(), CHAT)
    assert ref.uri == snapshot.url(policy_prefix(2))


def test_the_demo_tokenizer_loads_from_a_published_policy(tmp_path):
    from pipeline.demo import tokenizer as demo

    tok = demo_tokenizer()
    policy = tmp_path / "demo-policy"
    demo.save_tokenizer(tok, str(policy))  # chat template inside tokenizer_config.json
    (policy / "config.json").write_text(json.dumps({"vocab_size": len(tok)}))
    storage = Storage((tmp_path / "storage").as_uri())
    publish_policy(storage, 5, policy)
    loaded, ref = load_step_tokenizer(storage, 5)
    assert encode_chat(loaded, CHAT) == encode_chat(tok, CHAT)
    assert ref.tokenizer_fingerprint == load_policy_ref(storage, 5).tokenizer_fingerprint


def test_a_corrupt_tokenizer_file_is_refused(snapshot):
    key = f"{policy_prefix(2)}/tokenizer.json"
    snapshot.write_bytes(key, snapshot.read_bytes(key) + b" ")
    with pytest.raises(SnapshotError, match="differs from its manifest"):
        load_step_tokenizer(snapshot, 2)


def test_tokenize_step_writes_samples_counts_and_a_manifest(snapshot):
    cfg = TokenizeConfig(max_length=64, keep_tail=32, rows_per_file=4)
    s = tokenize_stage.run(snapshot, 2, cfg)
    assert (s.records_in, s.samples, s.dropped) == (10, 9, 1)
    assert s.dropped_reasons == {"no_masked_tokens": 1}
    assert s.dropped_examples[0]["sample_id"] == "z"
    assert (s.retokenize_checked, s.retokenize_mismatches) == (8, 1)
    assert s.mismatch_examples[0]["sample_id"] == "e1"
    assert s.sources == {"chat_template": 2, "exact": 8} and s.truncated == 1
    manifest = read_manifest(snapshot, tokenized_prefix(2))
    assert manifest.kind == TOKENIZED_KIND and not verify_manifest(
        snapshot, tokenized_prefix(2), manifest)
    assert [f.path for f in manifest.files] == [f"part-0000{i}.parquet" for i in range(3)]
    assert manifest.meta["retokenize_mismatches"] == 1 and manifest.meta["exact"] == 8
    assert manifest.meta["tokenizer_fingerprint"] == s.tokenizer_fingerprint
    assert manifest.meta["config"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    rows = [r for f in manifest.files for r in read_table(
        snapshot, f"{tokenized_prefix(2)}/{f.path}", TOKENIZED_SCHEMA).to_pylist()]
    assert [r["sample_id"] for r in rows] == [f"e{i}" for i in range(7)] + ["t0", "t-long"]
    assert sum(len(r["input_ids"]) for r in rows) == s.tokens
    assert sum(sum(r["loss_mask"]) for r in rows) == s.masked_tokens
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= 64 and r["step"] == 2
               for r in rows)
    tok = chatml_tokenizer()
    assert tok.decode(rows[-1]["input_ids"]).endswith("is 5. <|im_end|>")


def test_tokenize_step_is_deterministic(snapshot):
    tokenize_stage.run(snapshot, 2)
    first = {k: snapshot.read_bytes(k) for k in snapshot.list(tokenized_prefix(2))}
    tokenize_stage.run(snapshot, 2)
    assert {k: snapshot.read_bytes(k) for k in snapshot.list(tokenized_prefix(2))} == first


def test_run_config_mirrors_the_core_config():
    core = {f.name for f in dataclasses.fields(TokenizeConfig)}
    assert set(TokenizeRunConfig.model_fields) == core
    assert TokenizeRunConfig().to_core() == TokenizeConfig()
    assert TokenizeRunConfig(max_length=64, end_of_turn_tokens=["<|im_end|>"]).to_core() == \
        TokenizeConfig(max_length=64, end_of_turn_tokens=("<|im_end|>",))


@pytest.mark.integration
def test_asset_materializes_with_metadata(snapshot):
    with instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_steps", ["step-000002"])
        result = materialize(
            [tokenized_rollouts], partition_key="step-000002", instance=instance,
            resources={"storage": StorageResource(url=snapshot.root_url)},
            run_config={"ops": {"tokenized_rollouts": {"config": {"max_length": 64,
                                                                  "keep_tail": 32}}}})
        assert result.success
        (event,) = result.get_asset_materialization_events()
        meta = event.materialization.metadata
        assert meta["samples"].value == 9 and meta["dropped"].value == 1
        assert meta["retokenize_mismatches"].value == 1 and meta["truncated"].value == 1
        assert "no_masked_tokens" in meta["dropped_reasons"].value
        assert meta["mismatch_examples"].value[0]["sample_id"] == "e1"
        assert meta["exact"].value == 8 and meta["retokenized"].value == 2
        assert meta["uri"].value == snapshot.url(tokenized_prefix(2))
        assert instance.get_materialized_partitions(AssetKey("tokenized_rollouts")) == {
            "step-000002"}
