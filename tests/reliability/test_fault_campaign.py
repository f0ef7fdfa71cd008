"""The fault campaign (tests/reliability/campaign.py): every stage that talks to a service,
run through a TCP fault proxy, must end completed, retried by a named transient error or
failed by a named permanent one, with nothing committed partially, nothing lost or doubled,
no lock or lease left held, and the next run completing.

CI runs a sample of the faults (:data:`~tests.reliability.campaign.SAMPLE`); the whole
matrix, with the table the docs show, is::

    AERIE_FAULT_MATRIX=full pytest tests/reliability/test_fault_campaign.py -s

(``AERIE_FAULT_TABLE=PATH`` also writes the table there.)
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.reliability import fault_scenarios
from tests.reliability.campaign import FAULTS, SAMPLE, markdown_table, run_campaign
from tests.reliability.fault_proxy import Fault, FaultProxy

pytestmark = pytest.mark.integration

FULL = os.environ.get("AERIE_FAULT_MATRIX") == "full"
HANG_S = 60.0  # above every bound the scenarios configure (the slowest: S3, about 20 s)
SCENARIOS = {"s3": "SnapshotOnS3", "mlflow": "PromotionOnMlflow",
             "postgres": "LeaseOnPostgres", "sglang": "CaptureOnSGLang",
             "vllm": "CaptureOnVLLM", "disk": "SnapshotOnFullDisk"}
_TABLE: list = []


@pytest.fixture(scope="module", autouse=True)
def _write_table():
    yield
    if _TABLE and os.environ.get("AERIE_FAULT_TABLE"):
        Path(os.environ["AERIE_FAULT_TABLE"]).write_text(markdown_table(_TABLE) + "\n")


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_fault_ends_named_and_the_next_run_completes(name, tmp_path, request):
    if name == "postgres":
        request.getfixturevalue("postgres")  # skipped where PostgreSQL is not installed
    try:
        scenario = getattr(fault_scenarios, SCENARIOS[name])(tmp_path)
    except fault_scenarios.DiskUnavailable as e:
        pytest.skip(str(e))
    try:
        outcomes = run_campaign([scenario], tuple(FAULTS) if FULL else SAMPLE[name],
                                hang_s=HANG_S)
    finally:
        scenario.close()
    _TABLE.extend(outcomes)
    table = markdown_table(outcomes)
    print(f"\n{table}")
    failed = [o for o in outcomes if not o.holds]
    assert not failed, f"cases that do not hold:\n{markdown_table(failed)}"


# ---- the proxy does what each fault says ---------------------------------------------------


@pytest.fixture
def echo_port():
    """A server on 127.0.0.1 that answers each line with 4 KiB and keeps the connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def serve(conn):
        with conn:
            while not stop.is_set():
                try:
                    if not conn.recv(1024):
                        return
                    conn.sendall(b"x" * 4096)
                except OSError:
                    return

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()


def _ask(port: int, timeout: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"hi\n")
        got = b""
        while len(got) < 4096:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_the_proxy_forwards_and_each_fault_misbehaves_as_named(echo_port):
    with FaultProxy(echo_port) as proxy:
        assert _ask(proxy.port) == b"x" * 4096
        proxy.set(Fault("latency", delay_s=0.3))
        start = time.monotonic()
        assert _ask(proxy.port) == b"x" * 4096
        assert time.monotonic() - start >= 0.6  # the question and the answer each waited
        proxy.set(Fault("reset"))
        with pytest.raises(ConnectionResetError):
            _ask(proxy.port)
        proxy.set(Fault("blackhole"))
        with pytest.raises(TimeoutError):
            _ask(proxy.port, timeout=0.5)
        proxy.set(Fault("truncate", after_bytes=100))
        assert _ask(proxy.port) == b"x" * 100
        proxy.set(Fault("slow", rate=8192))
        start = time.monotonic()
        assert _ask(proxy.port) == b"x" * 4096
        assert time.monotonic() - start >= 0.4
        proxy.set(Fault("refuse"))
        with pytest.raises(ConnectionRefusedError):
            _ask(proxy.port)
        proxy.clear()
        assert _ask(proxy.port) == b"x" * 4096


def test_a_counted_fault_reaches_that_many_connections_then_forwards(echo_port):
    with FaultProxy(echo_port) as proxy:
        proxy.set(Fault("reset", count=2))
        for _ in range(2):
            with pytest.raises(ConnectionResetError):
                _ask(proxy.port)
        assert _ask(proxy.port) == b"x" * 4096
        assert proxy.stats == {"reset": 2}


def test_a_fault_reaches_connections_already_open(echo_port):
    with FaultProxy(echo_port) as proxy, socket.create_connection(
            ("127.0.0.1", proxy.port), timeout=0.5) as s:
        s.sendall(b"hi\n")
        assert len(s.recv(65536)) > 0
        proxy.set(Fault("blackhole"))
        while True:  # what was already on its way may still arrive
            try:
                if not s.recv(65536):
                    break
            except TimeoutError:
                break
        s.sendall(b"hi\n")
        with pytest.raises(TimeoutError):
            s.recv(65536)


def test_an_s3_upload_to_a_store_that_stops_answering_fails_within_its_bound(moto_endpoint):
    """The upload the campaign's timing may miss: a PutObject with a body (every manifest)
    to a black-holed store. botocore sends it with ``Expect: 100-continue``, which aiohttp
    awaits with no timeout: it hung for ever until Aerie's S3 clients stopped sending it."""
    import uuid

    from pipeline.storage import Storage
    from resources.storage import StorageResource

    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    Storage(f"s3://{bucket}", {"key": "k", "secret": "s", "endpoint_url": moto_endpoint}
            ).fs.mkdir(bucket)
    port = int(moto_endpoint.rsplit(":", 1)[1])
    with FaultProxy(port) as proxy:
        storage = StorageResource(url=f"s3://{bucket}/root", endpoint_url=f"http://{proxy.url_host}",
                                  access_key_id="k", secret_access_key="s", timeout_s=1.0,
                                  attempts=1).build()
        storage.write_bytes("warm.json", b"{}")
        proxy.set(Fault("blackhole"))
        done: list[BaseException | None] = []

        def write():
            try:
                storage.write_bytes("ds/_manifest.json", b'{"files": []}')
                done.append(None)
            except Exception as e:  # noqa: BLE001 - the error is what the test looks at
                done.append(e)

        worker = threading.Thread(target=write, daemon=True)
        worker.start()
        worker.join(30)  # the bound: 2 s3fs attempts x 1 x 1 s, plus backoff
        hung = worker.is_alive()
        proxy.set(Fault("reset"))  # frees a hung upload, so the thread ends either way
        worker.join(30)
    assert not hung, "the upload to a store that stops answering still waited after 30 s"
    assert done[0] is not None and "Read timeout" in str(done[0])
