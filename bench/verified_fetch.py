"""What verifying a download costs: a committed checkpoint fetched with and without checks.

A checkpoint of ``--files`` random files (``--mb`` MiB in all) is published with its manifest,
then fetched, interleaved per repetition, four ways:

- ``unverified``: ``Storage.download_dir``, the plain copy Aerie used before #13;
- ``copy+hash``: the same copy, then each local file hashed (a second pass over the data);
- ``verified``: ``DatasetCache.fetch`` into an empty cache: one pass that copies and hashes,
  checked against the manifest before the entry is renamed into place;
- ``cache hit``: ``DatasetCache.fetch`` again (sizes checked; the content was hashed on fill).

Backends: ``local`` (a file:// root on this disk) and ``s3`` (a moto_server on 127.0.0.1,
started and stopped by this script). Prints one table row per backend and way (median
seconds, MiB/s, ratio to ``unverified``) and writes the rows as JSON with ``--out``.

    python bench/verified_fetch.py --mb 512 --files 4 --reps 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.contracts import Manifest  # noqa: E402
from pipeline.manifest import entry_for, write_manifest  # noqa: E402
from pipeline.storage import Storage  # noqa: E402
from pipeline.verified import DatasetCache  # noqa: E402

PREFIX = "policies/step=000001"
CHUNK = 1 << 20


def make_checkpoint(root: Path, mb: int, files: int) -> Path:
    root.mkdir(parents=True)
    per_file = mb * 2**20 // files
    for i in range(files):
        with open(root / f"model-{i:05d}.safetensors", "wb") as f:
            left = per_file
            while left:
                n = min(left, 64 * CHUNK)
                f.write(os.urandom(n))
                left -= n
    return root


def publish(storage: Storage, checkpoint: Path) -> None:
    written = storage.upload_dir(checkpoint, PREFIX)
    write_manifest(storage, PREFIX, Manifest(
        kind="policy_checkpoint", kind_version=1,
        files=tuple(entry_for(PREFIX, w) for w in written), meta={}))


def hash_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    sha.update(chunk)


def ways(storage: Storage, scratch: Path) -> dict[str, Callable[[], None]]:
    def unverified() -> None:
        storage.download_dir(PREFIX, scratch / "plain")

    def copy_and_hash() -> None:
        storage.download_dir(PREFIX, scratch / "plain")
        hash_tree(scratch / "plain")

    def verified() -> None:
        DatasetCache(scratch / "cold").fetch(storage, PREFIX, label="policy")

    def cache_hit() -> None:
        DatasetCache(scratch / "warm").fetch(storage, PREFIX, label="policy")

    DatasetCache(scratch / "warm").fetch(storage, PREFIX, label="policy")  # fill once
    return {"unverified": unverified, "copy+hash": copy_and_hash, "verified": verified,
            "cache hit": cache_hit}


def measure(storage: Storage, scratch: Path, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    candidates = ways(storage, scratch)
    for rep in range(reps):
        order = list(candidates)
        order = order[rep % len(order):] + order[:rep % len(order)]  # rotate: no fixed slot
        for name in order:
            for leftover in ("plain", "cold"):
                shutil.rmtree(scratch / leftover, ignore_errors=True)
            started = time.perf_counter()
            candidates[name]()
            times.setdefault(name, []).append(time.perf_counter() - started)
    return times


@contextmanager
def moto() -> Iterator[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@contextmanager
def backend(name: str, work: Path) -> Iterator[Storage]:
    if name == "local":
        yield Storage((work / "store").as_uri())
        return
    with moto() as endpoint:
        options = {"key": "bench", "secret": "bench-secret", "endpoint_url": endpoint,
                   "skip_instance_cache": True}
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        storage = Storage(f"s3://{bucket}/root", options)
        storage.fs.mkdir(bucket)
        yield storage


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="checkpoint size, MiB")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aerie-bench-fetch-") as tmp:
        work = Path(tmp)
        checkpoint = make_checkpoint(work / "checkpoint", args.mb, args.files)
        for name in args.backends.split(","):
            with backend(name, work / name) as storage:
                publish(storage, checkpoint)
                times = measure(storage, work / name / "scratch", args.reps)
            base = statistics.median(times["unverified"])
            for way, seconds in times.items():
                median = statistics.median(seconds)
                rows.append({"backend": name, "way": way, "median_s": round(median, 3),
                             "mib_per_s": round(args.mb / median, 1),
                             "vs_unverified": round(median / base, 2),
                             "runs_s": [round(s, 3) for s in seconds]})
    print(f"{args.mb} MiB in {args.files} files, {args.reps} repetitions (median)")
    print(f"{'backend':8} {'way':11} {'seconds':>8} {'MiB/s':>8} {'× unverified':>13}")
    for r in rows:
        print(f"{r['backend']:8} {r['way']:11} {r['median_s']:8.3f} {r['mib_per_s']:8.1f} "
              f"{r['vs_unverified']:13.2f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
