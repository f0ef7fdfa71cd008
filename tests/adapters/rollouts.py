"""Rollouts of the demo task in the shapes RL frameworks keep them, for the adapter tests."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.demo import corpus, task
from pipeline.layout import raw_prefix
from pipeline.manifest import read_manifest
from pipeline.parquet import read_table
from pipeline.storage import Storage

PAD = 0


def token_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def conversation(tok, n: int, tool: bool):
    """Prompt ids, response ids and the response mask of one (optionally tool-using)
    rollout: assistant tokens 1, the tool turn's tokens 0."""
    problem = task.Problem(n, n + 1, width=2)
    prompt = corpus.encode_prompt(tok, task.prompt_messages(problem))
    answer = token_ids(tok, f"{2 * n + 1}") + [tok.eos_token_id]
    if not tool:
        return prompt, answer, [1] * len(answer)
    call = token_ids(tok, "call add") + [tok.eos_token_id]
    result = token_ids(tok, "<|start_header_id|>tool<|end_header_id|>\n7<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n")
    return prompt, call + result + answer, [1] * len(call) + [0] * len(result) + [1] * len(answer)


def copy_policy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)


def snapshot_records(storage: Storage, step: int) -> list[dict]:
    manifest = read_manifest(storage, raw_prefix(step))
    return [row for f in manifest.files if f.path.startswith("part")
            for row in read_table(storage, f"{raw_prefix(step)}/{f.path}").to_pylist()]
