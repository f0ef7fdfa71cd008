"""Policy checkpoints in storage: the HF directory that generated a step's rollouts.

A checkpoint is copied file by file (each atomic) to ``policies/step=NNNNNN/`` and committed
by a manifest; a trainer's own state beside the weights (HF Trainer's ``optimizer.pt``,
``rng_state*.pth``, DeepSpeed's ``global_step*/`` shards) is left behind. Its identity is a
content hash over (path, sha256) of its files, and its tokenizer is fingerprinted by the
tokenizer definition and the chat template (wherever the checkpoint keeps it), so that a
later stage can tell whether two snapshots were tokenized the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.contracts import FileEntry, Manifest
from pipeline.layout import policy_prefix
from pipeline.manifest import entry_for, write_manifest
from pipeline.snapshot.reader import checked_manifest, meta_int, meta_str
from pipeline.snapshot.sieve import StepArgumentError
from pipeline.storage import Storage

POLICY_KIND = "policy_checkpoint"
POLICY_KIND_VERSIONS = (1,)  # what load_policy_ref reads
_MAX_VOCAB = 2**31  # token ids are int32
_TOKENIZER_FILE = "tokenizer.json"
_TEMPLATE_FILE = "chat_template.jinja"
# what a training framework keeps beside the weights to resume, never part of the policy
_TRAINER_STATE = re.compile(r"(optimizer|scheduler|rng_state)[^/]*\.(pt|pth|bin)"
                            r"|trainer_state\.json|training_args\.bin|global_step[^/]*/.*"
                            r"|latest|zero_to_fp32\.py")


def is_policy_file(path: str) -> bool:
    """Whether ``path`` (relative, POSIX) in a checkpoint dir belongs to the policy rather
    than to the trainer's resume state."""
    return _TRAINER_STATE.fullmatch(path) is None


@dataclass(frozen=True)
class PolicyRef:
    """Where a policy checkpoint lives and what identifies it: ``key`` under the storage
    root (what records keep), ``uri`` its full URL now (what messages show)."""

    key: str
    uri: str
    sha256: str
    vocab_size: int
    tokenizer_fingerprint: str


def content_hash(entries: list[FileEntry] | tuple[FileEntry, ...]) -> str:
    sha = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.path):
        sha.update(f"{e.path}\0{e.sha256}\n".encode())
    return sha.hexdigest()


def tokenizer_fingerprint(files: dict[str, bytes]) -> str:
    """sha256 over the tokenizer definition and the chat template, whichever file holds it
    (``chat_template.jinja`` wins over ``tokenizer_config.json``, as transformers loads it),
    so that one template saved either way fingerprints the same."""
    sha = hashlib.sha256()
    if _TOKENIZER_FILE in files:
        sha.update(_TOKENIZER_FILE.encode() + b"\0" + files[_TOKENIZER_FILE])
    template = files[_TEMPLATE_FILE].decode() if _TEMPLATE_FILE in files else \
        json.loads(files.get("tokenizer_config.json", b"{}")).get("chat_template")
    sha.update(b"chat_template\0" + json.dumps(template).encode())
    return sha.hexdigest()


def publish_policy(storage: Storage, step: int, policy_dir: Path) -> PolicyRef:
    """Copy ``policy_dir`` into storage for ``step`` and commit it with a manifest. Its
    ``config.json`` and ``tokenizer_config.json`` are read and checked first: a file that is
    not a JSON object, or a ``vocab_size`` out of range, is a :class:`StepArgumentError`
    naming the file before anything is uploaded."""
    policy_dir = Path(policy_dir)
    if not (policy_dir / "config.json").is_file():
        raise FileNotFoundError(f"{policy_dir}: not an HF checkpoint (no config.json)")
    small = {name: (policy_dir / name).read_bytes()
             for name in ("config.json", "tokenizer_config.json", _TOKENIZER_FILE,
                          _TEMPLATE_FILE)
             if (policy_dir / name).is_file()}
    vocab_size = _checked_vocab_size(policy_dir, small)
    prefix = policy_prefix(step)
    written = storage.upload_dir(policy_dir, prefix, keep=is_policy_file)
    entries = tuple(entry_for(prefix, w) for w in written)
    ref = PolicyRef(key=prefix, uri=storage.url(prefix), sha256=content_hash(entries),
                    vocab_size=vocab_size, tokenizer_fingerprint=tokenizer_fingerprint(small))
    write_manifest(storage, prefix, Manifest(
        kind=POLICY_KIND, kind_version=1, files=entries,
        meta={"step": step, "sha256": ref.sha256, "vocab_size": ref.vocab_size,
              "tokenizer_fingerprint": ref.tokenizer_fingerprint}))
    return ref


def _checked_vocab_size(policy_dir: Path, small: dict[str, bytes]) -> int:
    """``config.json``'s ``vocab_size``, once both config files read as JSON objects and the
    chat template as UTF-8."""
    configs = {name: _json_object(policy_dir / name, small[name])
               for name in ("config.json", "tokenizer_config.json") if name in small}
    if _TEMPLATE_FILE in small:
        try:
            small[_TEMPLATE_FILE].decode()
        except UnicodeDecodeError as e:
            raise StepArgumentError(f"{policy_dir / _TEMPLATE_FILE}: not UTF-8 ({e})",
                                    url=str(policy_dir / _TEMPLATE_FILE)) from None
    vocab_size = configs["config.json"].get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not 0 < vocab_size < _MAX_VOCAB:
        raise StepArgumentError(
            f"{policy_dir / 'config.json'}: vocab_size {str(vocab_size)[:40]} is not an int "
            "in [1, 2**31)", url=str(policy_dir / "config.json"), field="vocab_size")
    return vocab_size


def _json_object(path: Path, data: bytes) -> dict:
    try:
        value = json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise StepArgumentError(f"{path}: not JSON ({type(e).__name__}: {str(e)[:120]})",
                                url=str(path)) from None
    if not isinstance(value, dict):
        raise StepArgumentError(f"{path}: expected a JSON object, got {type(value).__name__}",
                                url=str(path))
    return value


def load_policy_ref(storage: Storage, step: int) -> PolicyRef:
    """The committed policy checkpoint of ``step``.

    ``FileNotFoundError`` when none is committed; :class:`~.sieve.SnapshotError` naming the
    manifest and the field when it is not a policy manifest this release reads, or its
    ``sha256``, ``vocab_size`` (an integer, never a bool, in [1, 2**31]) or
    ``tokenizer_fingerprint`` is missing or malformed.
    """
    prefix = policy_prefix(step)
    manifest = checked_manifest(storage, prefix, POLICY_KIND, POLICY_KIND_VERSIONS)
    if manifest is None:
        raise FileNotFoundError(f"{storage.url(prefix)}: no committed policy checkpoint")
    return PolicyRef(
        key=prefix, uri=storage.url(prefix), sha256=meta_str(storage, prefix, manifest, "sha256"),
        vocab_size=meta_int(storage, prefix, manifest, "vocab_size", minimum=1,
                            maximum=_MAX_VOCAB),
        tokenizer_fingerprint=meta_str(storage, prefix, manifest, "tokenizer_fingerprint"))


def load_policy_config(storage: Storage, step: int) -> dict:
    """The ``config.json`` of ``step``'s committed policy checkpoint, checked against its
    manifest."""
    from pipeline.verified import committed, read_verified

    prefix = policy_prefix(step)
    return json.loads(read_verified(storage, prefix, committed(storage, prefix, POLICY_KIND),
                                    "config.json"))
