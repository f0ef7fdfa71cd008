"""The campaign's scenarios: Aerie's stages against the real services, each service behind a
fault proxy. Every client is built the way the resources build it; the only settings
changed are the deadlines and attempts, shortened (each constant below says from what) so
that a black hole costs seconds: the outcomes are Aerie's, the times scale with those.

- S3 (``moto_server``): the RL trainer's snapshot writer, then the ingest stage
  (``pipeline.snapshot``), through :class:`~resources.storage.StorageResource`.
- The MLflow server: a drafter registered from its run and promoted by the gate
  (``DrafterRegistry.publish`` and ``pipeline.release.promotion.promote``).
- PostgreSQL: the promotion lease (``PostgresLease``: acquire, a fenced write, release).
- SGLang and vLLM (the contract servers): hidden-state capture of one RL step
  (``pipeline.capture.stage.run`` with the ``sglang`` and ``vllm`` backends).
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path

from bench.local_postgres import PostgresServer
from pipeline.storage import Storage
from tests.conftest import ServerProcess, free_port
from tests.reliability.campaign import Scenario
from tests.reliability.fault_proxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]
KEY, SECRET = "aerie-faults", "aerie-faults-secret"
STEP = 3


class _Service:
    """A server process on a fixed port that can be stopped and started again."""

    def __init__(self, cmd: list[str], port: int, log: Path, ready_probe=None, **popen):
        self.cmd, self.port, self.log, self.probe, self.popen = cmd, port, log, ready_probe, popen
        self.server: ServerProcess | None = None
        self.start()

    def start(self) -> None:
        self.server = ServerProcess(self.cmd, self.log, group=True, **self.popen)
        self.server.wait_ready([self.port], timeout=120, probe=self.probe)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace_s=10)
            self.server = None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


# -- S3 -------------------------------------------------------------------------------------


class _Snapshot(Scenario):
    """The RL trainer's snapshot writer, then the ingest stage, on :meth:`storage`."""

    stage = "snapshot write, then ingest"
    RECORDS = 40

    def storage(self, *, direct: bool = False) -> Storage:
        raise NotImplementedError

    def run(self) -> None:
        from pipeline.snapshot import stage
        from pipeline.snapshot.writer import SnapshotWriter
        from tests.snapshot.conftest import good_record

        storage = self.storage()
        records = [good_record(i, STEP) for i in range(self.RECORDS)]
        SnapshotWriter(storage, rows_per_file=8).write_step(STEP, records, self.policy_dir,
                                                            STEP)
        stage.run(storage, STEP, rows_per_file=8)

    def partial(self) -> list[str]:
        from pipeline.layout import raw_prefix, snapshot_prefix

        return _unverified(self.storage(direct=True), (raw_prefix(STEP), snapshot_prefix(STEP)))

    def settled(self) -> list[str]:
        from pipeline.snapshot.stage import read_accepted

        problems = self.partial()
        rows = read_accepted(self.storage(direct=True), STEP).num_rows
        if rows != self.RECORDS:
            problems.append(f"{rows} of {self.RECORDS} records ingested")
        return problems


class SnapshotOnS3(_Snapshot):
    service = "S3 (moto_server)"
    restartable = False  # moto keeps its objects in memory: a restart loses them all

    def __init__(self, work: Path):
        port = free_port()
        self.moto = _Service([_exe("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port,
                             work / "moto.log")
        self.direct = f"http://127.0.0.1:{port}"
        self.proxies = [FaultProxy(port)]
        self.work = work

    def prepare(self) -> None:
        from tests.snapshot.conftest import make_policy_dir

        self.bucket = f"faults-{uuid.uuid4().hex[:10]}"
        self.storage(direct=True, root=False).fs.mkdir(self.bucket)
        self.policy_dir = make_policy_dir(self.work / f"policy-{self.bucket}")

    def storage(self, *, direct: bool = False, root: bool = True) -> Storage:
        from resources.storage import StorageResource

        endpoint = self.direct if direct else f"http://{self.proxies[0].url_host}"
        url = f"s3://{self.bucket}/root" if root else f"s3://{self.bucket}"
        return StorageResource(url=url, endpoint_url=endpoint, access_key_id=KEY,
                               secret_access_key=SECRET, timeout_s=S3_TIMEOUT_S,
                               attempts=S3_ATTEMPTS,
                               cache_dir=str(self.work / "cache")).build()

    def settled(self) -> list[str]:
        problems = super().settled()
        uploads = self.storage(direct=True).fs.call_s3("list_multipart_uploads",
                                                       Bucket=self.bucket)
        if uploads.get("Uploads"):
            problems.append(f"{len(uploads['Uploads'])} multipart uploads left open")
        return problems

    def close(self) -> None:
        self.proxies[0].stop()
        self.moto.stop()


class DiskUnavailable(RuntimeError):
    """No small filesystem can be mounted here (mounting needs root)."""


class SnapshotOnFullDisk(_Snapshot):
    service = "local storage (a 1 MiB tmpfs)"
    restartable = False

    def __init__(self, work: Path):
        import subprocess

        self.work, self.mount = work, work / "disk"
        self.mount.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                                   str(self.mount)], capture_output=True, text=True)
        except OSError as e:  # no mount command at all
            raise DiskUnavailable(f"cannot mount a tmpfs: {e}") from e
        if done.returncode != 0:
            raise DiskUnavailable(f"cannot mount a tmpfs: {done.stderr.strip()}")

    def supports(self, fault_name: str) -> bool:
        from tests.reliability.campaign import DISK_FULL, FAULTS

        return FAULTS[fault_name] == DISK_FULL

    def prepare(self) -> None:
        from tests.snapshot.conftest import make_policy_dir

        self.root = self.mount / f"storage-{uuid.uuid4().hex[:8]}"
        self.policy_dir = make_policy_dir(self.work / f"policy-{self.root.name}")

    def storage(self, *, direct: bool = False) -> Storage:
        return Storage(self.root.as_uri(), cache_dir=self.work / "cache")

    def fill_disk(self) -> None:
        """All but 24 KiB taken: the policy and the first parts fit, the rest does not."""
        import os

        free = os.statvfs(self.mount).f_bavail * os.statvfs(self.mount).f_frsize
        (self.mount / "filler").write_bytes(b"\0" * max(0, free - 24 * 1024))

    def free_disk(self) -> None:
        (self.mount / "filler").unlink(missing_ok=True)

    def settled(self) -> list[str]:
        problems = super().settled()
        litter = [p.name for p in self.root.rglob("*.tmp")]
        if litter:
            problems.append(f"temporary files left: {litter}")
        return problems

    def close(self) -> None:
        import subprocess

        subprocess.run(["umount", str(self.mount)], check=False, capture_output=True)


def _unverified(storage: Storage, prefixes) -> list[str]:
    """Each committed dataset under ``prefixes`` whose files do not match its manifest."""
    from pipeline.manifest import read_manifest, verify_manifest

    problems = []
    for prefix in prefixes:
        manifest = read_manifest(storage, prefix)
        if manifest is not None:
            problems += [f"{prefix}: {p}" for p in verify_manifest(storage, prefix, manifest)]
    return problems


# -- the MLflow server ------------------------------------------------------------------------


class PromotionOnMlflow(Scenario):
    service = "MLflow server"
    stage = "register the drafter, the gate promotes it"

    def __init__(self, work: Path):
        import requests

        port = free_port()
        self.work = work
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return requests.get(f"{url}/health", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        import os

        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.mlflow = _Service(
            [_exe("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
             "1", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
             "--artifacts-destination", (work / "artifacts").as_uri()],
            port, work / "mlflow.log", ready_probe=healthy, env=env)
        self.direct = url
        self.proxies = [FaultProxy(port)]
        self.storage = Storage((work / "storage").as_uri())
        from tests.release.helpers import make_drafter_dir

        self.drafter_dir = make_drafter_dir(work / "drafter")

    def registry(self, *, direct: bool = False):
        from resources.mlflow import MlflowResource

        url = self.direct if direct else f"http://{self.proxies[0].url_host}"
        return MlflowResource(tracking_uri=url, target_family=self.family,
                              lock_dir=str(self.work), request_timeout_s=MLFLOW_TIMEOUT_S,
                              request_retries=MLFLOW_RETRIES).build()

    def prepare(self) -> None:
        from tests.release.helpers import publish_drafter

        self.family = f"f{uuid.uuid4().hex[:10]}"
        self.fingerprint = uuid.uuid4().hex
        self.drafter_uri = publish_drafter(self.storage, 10, self.drafter_dir,
                                           self.fingerprint)

    def serving(self):
        from pipeline.release.backend import LedgerBackend
        from pipeline.release.ledger import ServingLedger
        from tests.release.helpers import SETTINGS

        return LedgerBackend(ServingLedger(self.storage, self.registry(direct=True).model_name),
                             SETTINGS)

    def run(self) -> None:
        from pipeline.release.promotion import promote
        from tests.release.helpers import gate, lineage

        registry = self.registry()
        registered = registry.publish(drafter_dir=self.drafter_dir,
                                      lineage=lineage(self.fingerprint, self.drafter_uri))
        promote(registry, self.serving(), registered.version.version, gate(3.0, None))

    def settled(self) -> list[str]:
        from pipeline.release.lock import FileLock
        from pipeline.release.mlflow_registry import model_name

        registry = self.registry(direct=True)
        problems = []
        versions = [v for v in registry.versions() if v.fingerprint == self.fingerprint]
        if len(versions) != 1:
            problems.append(f"{len(versions)} versions registered for one drafter")
        champion = registry.champion()
        served = self.serving().current()
        if champion is None or served is None or served.target is None:
            problems.append("no champion or nothing served after the promotion completed")
        elif served.target.registry_version != champion.version:
            problems.append(f"serving v{served.target.registry_version}, champion "
                            f"v{champion.version}")
        if champion is not None:
            promoted = [d for d in registry.decisions(champion.version).values()
                        if d.decision == "promoted"]
            if len(promoted) != 1:
                problems.append(f"{len(promoted)} promotion decisions recorded")
        try:
            with FileLock(self.work / f"promotion-{model_name(self.family)}.lock",
                          timeout_s=1):
                pass
        except Exception as e:  # noqa: BLE001 - any failure to take it is the finding
            problems.append(f"the promotion lock is still held: {e}")
        return problems

    def stop_service(self) -> None:
        self.mlflow.stop()

    def start_service(self) -> None:
        self.mlflow.start()

    def close(self) -> None:
        self.proxies[0].stop()
        self.mlflow.stop()


# -- PostgreSQL -----------------------------------------------------------------------------


class LeaseOnPostgres(Scenario):
    service = "PostgreSQL"
    stage = "promotion lease: acquire, fenced writes, release"
    restart_after_s = 0.3

    def __init__(self, work: Path):
        self.server = PostgresServer(free_port())
        self.url = self.server.new_database("faults")
        self.proxies = [FaultProxy(self.server.port)]

    def _url(self, direct: bool) -> str:
        return self.url if direct else self.url.replace(
            f"127.0.0.1:{self.server.port}", self.proxies[0].url_host)

    def prepare(self) -> None:
        self.name = f"faults-{uuid.uuid4().hex[:10]}"

    def run(self) -> None:
        import time

        from pipeline.release.lease import PostgresLease

        # held for about a second, as a promotion holds it across the serving update and the
        # alias move: one fenced write every 0.2 s
        with PostgresLease(self._url(direct=False), self.name, timeout_s=10,
                           io_timeout_s=LEASE_IO_TIMEOUT_S) as lease:
            for _ in range(6):
                with lease.fenced():
                    time.sleep(0.2)

    def settled(self) -> list[str]:
        from pipeline.release.lease import PostgresLease

        try:
            with PostgresLease(self._url(direct=True), self.name, timeout_s=5):
                return []
        except Exception as e:  # noqa: BLE001 - any failure to take it is the finding
            return [f"the lease cannot be taken afterwards: {e}"]

    def stop_service(self) -> None:
        self.server.shutdown()

    def start_service(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.proxies[0].stop()
        self.server.stop()


# -- SGLang -----------------------------------------------------------------------------------


class _Capture(Scenario):
    """Hidden-state capture of one RL step against an engine's servers, behind proxies."""

    stage = "hidden-state capture of one RL step"
    engine: _Service
    ports: dict[str, int]

    def prepare(self) -> None:
        from tests.capture.helpers import lengths, write_tokenized

        self.storage = Storage((self.work / f"storage-{uuid.uuid4().hex[:8]}").as_uri())
        self.samples = len(write_tokenized(self.storage, STEP, lengths(CAPTURE_SAMPLES)))

    def run(self) -> None:
        from pipeline.capture import stage
        from tests.capture.helpers import CONFIG

        with self.backend() as backend:
            stage.run(self.storage, STEP, backend, CONFIG)

    def backend(self):
        raise NotImplementedError

    def partial(self) -> list[str]:
        from pipeline.layout import shards_prefix

        return _unverified(self.storage, (shards_prefix(STEP),))

    def settled(self) -> list[str]:
        from pipeline.capture.shards import read_shards_manifest

        problems = self.partial()
        manifest = read_shards_manifest(self.storage, STEP)
        rows = sum(f.rows or 0 for f in manifest.files)
        if rows != self.samples:
            problems.append(f"{rows} of {self.samples} samples captured")
        return problems

    def stop_service(self) -> None:
        self.engine.stop()

    def start_service(self) -> None:
        self.engine.start()
        self.wait_ready()

    def wait_ready(self) -> None:
        for port in self.ports.values():
            self.engine.server.wait_ready([port], timeout=120)

    def close(self) -> None:
        for p in self.proxies:
            p.stop()
        self.engine.stop()


class CaptureOnSGLang(_Capture):
    service = "SGLang (contract server)"

    def __init__(self, work: Path):
        import json

        from tests.sglang_contract.fixtures import save_tiny_llama

        self.work = work
        model_dir = save_tiny_llama(work / "tiny_llama")
        ports = {"aux": free_port(), "final": free_port()}
        cmd = [sys.executable, "-m", "tests.sglang_contract.server", "--model", str(model_dir)]
        for mode, port in ports.items():
            cmd += ["--endpoint", json.dumps({"port": port, "mode": mode})]
        self.engine = _Service(cmd, max(ports.values()), work / "sglang.log", cwd=ROOT)
        self.ports = ports
        self.wait_ready()
        self.proxies = [FaultProxy(ports["aux"]), FaultProxy(ports["final"])]

    def backend(self):
        from pipeline.capture.sglang import SGLangCaptureConfig
        from tests.sglang_contract.fixtures import AUX_IDS, HIDDEN, LAYERS

        return SGLangCaptureConfig(
            aux_urls=[f"http://{self.proxies[0].url_host}"],
            final_urls=[f"http://{self.proxies[1].url_host}"], hidden_size=HIDDEN,
            aux_layer_ids=AUX_IDS, num_target_layers=LAYERS, timeout_s=CAPTURE_TIMEOUT_S,
        ).build()


class CaptureOnVLLM(_Capture):
    """vLLM's hidden-state export: one server that answers over HTTP and writes each
    request's states to a file (its stand-in computes them with the real model). Besides
    the shards, nothing of the server's files may be left once the capture completes."""

    service = "vLLM (contract server)"

    def __init__(self, work: Path):
        from tests.sglang_contract.fixtures import AUX_IDS, LAYERS, save_tiny_llama
        from tests.vllm_contract.fixtures import capture_command

        self.work = work
        self.model_dir = save_tiny_llama(work / "tiny_llama")
        self.files = work / "hidden-states"
        self.files.mkdir()
        port = free_port()
        self.ports = {"vllm": port}
        self.engine = _Service(capture_command(self.model_dir, self.files, AUX_IDS, LAYERS,
                                               port), port, work / "vllm.log", cwd=ROOT)
        self.proxies = [FaultProxy(port)]

    def prepare(self) -> None:
        from pipeline.snapshot.policy import publish_policy

        super().prepare()
        publish_policy(self.storage, STEP, self.model_dir)

    def backend(self):
        from pipeline.capture.final_norm import load_final_norm
        from pipeline.capture.vllm import VLLMCaptureConfig
        from tests.sglang_contract.fixtures import AUX_IDS, HIDDEN, LAYERS

        return VLLMCaptureConfig(
            urls=[f"http://{self.proxies[0].url_host}"], files_dir=str(self.files),
            hidden_size=HIDDEN, aux_layer_ids=AUX_IDS, num_target_layers=LAYERS,
            final_norm=load_final_norm(self.storage, STEP), timeout_s=CAPTURE_TIMEOUT_S,
            file_timeout_s=CAPTURE_TIMEOUT_S, cleanup_timeout_s=CAPTURE_TIMEOUT_S).build()

    def settled(self) -> list[str]:
        left = sorted(p.name for p in self.files.iterdir())
        return super().settled() + ([f"server files left: {left[:4]}"] if left else [])


# MLflow's per-request deadline and retries in this campaign; a deployment's defaults are
# 30 s and 3 (a server that stops answering costs a request (retries + 1) x the deadline,
# plus 2 + 4 + ... s of backoff).
MLFLOW_TIMEOUT_S, MLFLOW_RETRIES = 3, 2
# S3's per-request deadline and attempts in this campaign; a deployment's defaults are 20 s
# and 3 (a store that stops answering costs an operation about 2 x attempts x the deadline,
# plus backoff).
S3_TIMEOUT_S, S3_ATTEMPTS = 2.0, 2
# The capture's per-call deadline in this campaign. A deployment's default is 600 s (a
# prefill of a long batch on a large target may take minutes); the bound a hung server
# costs is this deadline times the attempts (max_retries + 1), whatever it is set to.
CAPTURE_TIMEOUT_S = 2.0
# The lease's deadline for each round trip to the database in this campaign (a
# deployment's default: 30 s).
LEASE_IO_TIMEOUT_S = 3.0
# enough samples that the capture still runs when a mid-run fault starts (about 4 s here)
CAPTURE_SAMPLES = 96
