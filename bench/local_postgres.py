"""A real PostgreSQL server for the tests and benchmarks: Debian's ``postgresql`` binaries,
a fresh cluster in a temporary directory, listening on 127.0.0.1 only, stopped by PID.

PostgreSQL refuses to run as root; under root (CI's machines) ``initdb`` and ``postgres`` run
as the ``postgres`` user the Debian package creates. The superuser (``aerie``) connects over
TCP without a password; every other role must give its password (SCRAM), as on a real
server. Durability is switched off (``fsync``, ``full_page_writes``): the cluster lives for
one test session or one benchmark.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

SUPERUSER = "aerie"


def postgres_bin(name: str) -> str:
    """``name`` from the newest ``/usr/lib/postgresql/*/bin`` (Debian keeps them off PATH),
    else from PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                   key=lambda p: int(p.split("/")[4]))
    path = found[-1] if found else shutil.which(name)
    if not path:
        raise RuntimeError(f"PostgreSQL's {name} is not installed: apt-get install postgresql "
                           f"(.ci/run does)")
    return path


class PostgresServer:
    """One cluster on a free port of 127.0.0.1; :meth:`new_database` gives each test its own
    database."""

    def __init__(self, port: int, *, max_connections: int = 300):
        self.port = port
        self.root = Path(tempfile.mkdtemp(prefix="aerie-postgres-"))
        self._as = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        data = self.root / "data"
        subprocess.run([postgres_bin("initdb"), "-D", str(data), "-U", SUPERUSER,
                        "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"],
                       check=True, capture_output=True, **self._as)
        # the superuser connects without a password; every other role needs its own
        (data / "pg_hba.conf").write_text(
            f"local all all trust\nhost all {SUPERUSER} 127.0.0.1/32 trust\n"
            f"host all all 127.0.0.1/32 scram-sha-256\n")
        self.log = open(self.root / "server.log", "wb")
        self._cmd = [postgres_bin("postgres"), "-D", str(data), "-h", "127.0.0.1",
                     "-p", str(port), "-k", str(self.root), "-c", "fsync=off",
                     "-c", "full_page_writes=off", "-c", "synchronous_commit=off",
                     "-c", f"max_connections={max_connections}"]
        self.start()

    def start(self) -> None:
        """Start the server (again: after :meth:`shutdown`, on the same port and data)."""
        self.proc = subprocess.Popen(self._cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     **self._as)
        self._wait_ready()


    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        import psycopg2

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: "
                                   f"{(self.root / 'server.log').read_text()[-2000:]}")
            try:
                psycopg2.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def url(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self, prefix: str = "aerie", template: str | None = None) -> str:
        """A new database, empty or a copy of the database at URL ``template`` (PostgreSQL
        copies one only while nobody is connected to it); its URL."""
        import psycopg2

        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        copy = f' TEMPLATE "{template.rsplit("/", 1)[1]}"' if template else ""
        conn = psycopg2.connect(self.url("postgres"))
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"{copy}')
        finally:
            conn.close()
        return self.url(name)

    def stop(self) -> None:
        """Fast shutdown (SIGINT) by PID, then the cluster's directory goes."""
        self.shutdown()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def shutdown(self) -> None:
        """Fast shutdown (SIGINT) by PID; the cluster stays for :meth:`start`."""
        try:
            os.kill(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
