"""Small fake drafters (random weights, no training), their published form in storage, and
the gate settings and evaluation summaries the promotion tests decide with."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import replace
from pathlib import Path

from pipeline.contracts import Manifest
from pipeline.eagle3.export import save_drafter
from pipeline.eagle3.spec import SpecParams
from pipeline.layout import drafter_prefix
from pipeline.manifest import entry_for, read_manifest, write_manifest
from pipeline.release.backend import LedgerBackend
from pipeline.release.gate import Candidate, EvalSummary, GatePolicy, decide
from pipeline.release.ledger import ServingLedger
from pipeline.release.mlflow_registry import DrafterRegistry
from pipeline.serving_now import ServingTarget
from pipeline.storage import Storage
from tests.evaluation.world import STEPS

TARGET_VOCAB = 48
SETTINGS = SpecParams(3, 1, 4)
POLICY = GatePolicy(min_relative_gain=0.02, min_cycles=10)


def summary(tau: float, version: str | None = None) -> EvalSummary:
    """An evaluation over 100 cycles whose settings and held-out keys agree."""
    return EvalSummary(tau=tau, cycles=100, emitted_tokens=int(100 * tau), alpha=(0.8,),
                       settings_key="S", heldout_key="H", drafter_version=version)


def create_mlflow_tables(url: str) -> None:
    """MLflow's tables in the empty database at ``url``, as its client creates them on first
    use (its migrations: ~3 s)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(url, default_artifact_root="unused:/")


def make_drafter_dir(path: Path, seed: int = 0, *, draft_vocab_size: int = 24,
                     hidden_size: int = 32, v31: bool = False) -> Path:
    """A valid SGLang-format drafter directory (~30 KB, fp32, random weights); ``v31``:
    EAGLE 3.1.

    The target config is a plain dict (no transformers import: it costs seconds).
    """
    import torch

    from pipeline.eagle3.config import DrafterConfig
    from pipeline.eagle3.model import Eagle3Drafter
    from pipeline.vocab.mapping import build_vocab_mapping

    target = {"hidden_size": hidden_size, "intermediate_size": 48, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": TARGET_VOCAB,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    config = DrafterConfig.from_target(target, draft_vocab_size=draft_vocab_size)
    if v31:
        config = replace(config, fc_norm=True, norm_output=True)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(config, torch.randn(TARGET_VOCAB, hidden_size, generator=g))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    counts = torch.randint(0, 20, (TARGET_VOCAB,), generator=g)
    mapping = build_vocab_mapping(counts, draft_vocab_size)
    model.set_vocab(mapping.d2t, mapping.t2d)
    return save_drafter(model, config, path, dtype=torch.float32, overwrite=True)


def make_dflash_dir(path: Path, seed: int = 0, *, block_size: int = 6) -> Path:
    """A valid DFlash drafter directory (two layers, fp32, random weights) of the same
    target as :func:`make_drafter_dir`'s."""
    import torch

    from pipeline.dflash.config import DFlashConfig
    from pipeline.dflash.export import save_drafter as save_dflash
    from pipeline.dflash.model import DFlashDrafter

    target = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": TARGET_VOCAB,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "model_type": "llama"}
    config = DFlashConfig.from_target(target, layers=2, block_size=block_size)
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(TARGET_VOCAB, 32, generator=g)
    model = DFlashDrafter(config, table, table)
    return save_dflash(model, path, dtype=torch.float32, overwrite=True)


def publish_drafter(storage: Storage, step: int, local_dir: Path,
                    fingerprint: str | None = None) -> str:
    """Publish ``local_dir`` as ``drafters/step=NNNNNN`` with a manifest whose fingerprint
    is ``fingerprint`` (default: a digest of the files); returns its URL."""
    prefix = f"drafters/step={step:06d}"
    written = storage.upload_dir(local_dir, prefix)
    fingerprint = fingerprint or hashlib.sha256(
        b"".join(w.sha256.encode() for w in written)).hexdigest()
    write_manifest(storage, prefix, Manifest(
        kind="drafter_checkpoint", kind_version=1,
        files=tuple(entry_for(prefix, w) for w in written),
        meta={"step": step, "fingerprint": fingerprint}))
    return storage.url(prefix)


def lineage(fingerprint: str, drafter_uri: str, *, step: int = 10, tau: float = 2.5,
            **overrides) -> dict:
    """A complete lineage record for registering a fake drafter."""
    record = {
        "fingerprint": fingerprint, "drafter_uri": drafter_uri, "rl_step": step,
        "rl_step_window": [step - 2, step - 1, step], "policy_uri": f"file:///policy/{step}",
        "policy_sha256": "ab" * 32,
        "shard_manifest_sha256": {str(s): f"{s:064x}" for s in (step - 2, step - 1, step)},
        "aux_layer_ids": [1, 3, 4], "vocab_mapping_key": "cd" * 32, "tau": tau,
        "alpha": [0.8, 0.6, 0.4], "dagster_run_id": "run-123",
    }
    record.update(overrides)
    return record


class Drafters:
    """Three published drafters: v1 and v2 alike in shape, v3 wider."""

    def __init__(self, tmp_path: Path, name: str):
        self.storage = Storage((tmp_path / "storage").as_uri())
        self.dirs, self.targets = {}, {}
        for v, seed, hidden in (("1", 1, 32), ("2", 2, 32), ("3", 3, 64)):
            local = make_drafter_dir(tmp_path / f"d{v}", seed, hidden_size=hidden)
            uri = publish_drafter(self.storage, int(v), local, fingerprint=f"fp{v}")
            self.dirs[v] = local
            self.targets[v] = ServingTarget(drafter_uri=uri, fingerprint=f"fp{v}",
                                            registry_model=name, registry_version=v)
        self.manifest = LedgerBackend(ServingLedger(self.storage, name), SETTINGS)

    def digest(self, version: str) -> str:
        from tests.vllm_contract.server import Eagle3Drafter  # vLLM's view of the weights

        return Eagle3Drafter(self.dirs[version]).digest()


def register(registry: DrafterRegistry, storage: Storage, drafter_dir, step: int) -> str:
    """``drafter_dir`` published for ``step`` and registered; its version."""
    fingerprint = uuid.uuid4().hex
    uri = publish_drafter(storage, step, drafter_dir, fingerprint)
    reg = registry.publish(drafter_dir=drafter_dir,
                           lineage=lineage(fingerprint, uri, step=step))
    return reg.version.version


def gate(tau: float, champion: EvalSummary | None):
    """The gate's decision for a candidate of τ ``tau`` against ``champion``."""
    return decide(Candidate(summary(tau), format_ok=True), champion, None, POLICY)


def served_version(serving) -> str | None:
    """The registry version ``serving`` serves now (None: no drafter)."""
    current = serving.current()
    return current.target.registry_version if current and current.target else None


def as_refresh(storage, step: int, prefix: str, fingerprint: str) -> str:
    """Give a published test drafter the lineage the training stage writes, at ``step``."""
    target = drafter_prefix(step)
    m = read_manifest(storage, prefix)
    files = storage.download_dir(prefix, storage.local_path("").parent / f"tmp-{fingerprint}")
    (files / "_manifest.json").unlink()
    written = storage.upload_dir(files, target)

    meta = {**m.meta, "step": step, "fingerprint": fingerprint, "policy_sha256": "p" * 64,
            "shard_manifest_sha256": {str(s): "s" * 64 for s in STEPS},
            "aux_layer_ids": [1, 2, 3], "vocab_cache_key": "v" * 64, "coverage": 0.9,
            "config": {"ttt_depth": 2, "lr": 1e-3},
            "result": {"history": [{"step": 1, "lr": 1e-3, "loss": 3.0,
                                    "accuracy": [0.5, 0.25], "sim_accept_length": 0.6}]}}
    write_manifest(storage, target, type(m)(kind=m.kind, kind_version=m.kind_version,
                                            files=tuple(entry_for(target, w) for w in written),
                                            meta=meta))
    return target
