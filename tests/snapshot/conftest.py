from __future__ import annotations

import json
from pathlib import Path

import pytest

VOCAB = 100


def make_policy_dir(path: Path, vocab_size: int = VOCAB) -> Path:
    """A stand-in HF checkpoint: what the snapshot writer reads from a policy dir."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


@pytest.fixture
def policy_dir(tmp_path) -> Path:
    return make_policy_dir(tmp_path / "policy")


def good_record(i: int, step: int = 3) -> dict:
    return {
        "rollout_id": f"r{step}-{i}",
        "trainer_step": step,
        "generated_by_policy_version": step,
        "messages": [{"role": "user", "content": f"what is {i}+1?"},
                     {"role": "assistant", "content": f"{i + 1} ✓"}],
        "prompt_token_ids": [1, 2, 3 + i % 50],
        "response_token_ids": [4 + i % 50, 5],
        "reward": 0.5,
        "finish_reason": "stop",
        "token_fidelity": "exact",
    }


def replace_json(storage, key: str, value) -> None:
    """Overwrite a manifest (or any JSON file) with ``value``, however malformed."""
    storage.write_bytes(key, json.dumps(value).encode())


def edit_manifest(storage, prefix: str, edit) -> None:
    """Rewrite ``prefix``'s manifest as ``edit(dict)`` returns it."""
    key = f"{prefix}/_manifest.json"
    replace_json(storage, key, edit(json.loads(storage.read_bytes(key))))


def rewrite_part(storage, prefix: str, path: str, table) -> None:
    """Replace a data file and re-hash it in the manifest, as a (mis)behaving writer would."""
    from pipeline.manifest import entry_for
    from pipeline.parquet import write_table

    written = entry_for(prefix, write_table(storage, f"{prefix}/{path}", table))

    def rehash(m):
        for f in m["files"]:
            if f["path"] == path:
                f["bytes"], f["sha256"] = written.bytes, written.sha256
        return m

    edit_manifest(storage, prefix, rehash)
