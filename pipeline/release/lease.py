"""The promotion lock across hosts: a lease in PostgreSQL with a fencing token.

Promotions from several machines (Dagster run workers on different hosts, an operator's
``promote_drafter_manually``) must not interleave their read-champion → update-serving →
move-alias sequences; MLflow's alias moves are last-writer-wins and the serving ledger is
plain objects. The host-local :class:`~pipeline.release.lock.FileLock` cannot see another
machine. This lease lives in the PostgreSQL database a multi-host deployment already runs
(Dagster's and MLflow's), rather than in a conditional write to object storage: an object
lock needs an expiry (a dead holder never deletes it) and with it the holders' clocks,
while a database session ends when its holder dies.

Invariants:

- **Exclusion and liveness**: the holder keeps a session-level advisory lock
  (``pg_try_advisory_lock`` on a key derived from the model name) on a connection of its
  own for as long as it holds the lease. A holder process that dies closes that connection
  and releases the lease at once. A host that crashes or drops off the network holds it
  until the server notices the session is gone: the session asks the server to probe it
  after 30 s of silence (TCP keepalives every 10 s, 3 probes), about a minute in all. No
  clock is involved. Not through a pooler in transaction mode (PgBouncer): session locks
  need the session.
- **Fencing token**: each acquisition raises the lease row's ``token``
  (``aerie_promotion_lease``) to ``max(token + 1, the database's clock in ms)``, so tokens
  only grow, even across a re-created table.
- **Fenced writes**: every write made under the lease runs inside :meth:`fenced`, which
  first reads the lease row on the holder's own session: a session that ended (so that
  another promoter may hold the lease now) or a token that moved on is :class:`LeaseLost`,
  before anything is written. The serving ledger also keeps the token of each manifest and
  refuses a lower one (:meth:`~pipeline.release.ledger.ServingLedger.publish`).
- What no lock can undo: a write already under way when the holder's session ends (a
  restart hook of several minutes, say) may finish after the next holder's writes. The
  next holder cannot start before the server ended the old session, and the ledger's token
  check refuses every later write of the stale holder.
- Waits at most ``timeout_s`` (polling), then raises
  :class:`~pipeline.release.lock.LockTimeout` naming the holder.
- **No statement waits for ever.** Every round trip to the database (connecting included)
  has a client-side deadline of ``io_timeout_s``: the connection is asynchronous and each
  answer is awaited with ``poll``. A server that stops answering (hung, or a proxy in
  between that keeps the TCP connection up, so keepalives see nothing wrong) costs an
  acquisition :class:`LeaseUnavailable` and a fenced write :class:`LeaseLost` within that
  bound, instead of a promotion that hangs (found by the fault campaign,
  tests/reliability/test_fault_campaign.py). The holder then closes its side: a server
  that is still up ends the session, and its advisory lock, at once; a hung one holds it
  until it notices, and other promoters wait for it (:class:`LockTimeout`), never share it.
  Host names are resolved before the deadline applies (use an address or a resolver that
  answers).
- The connection URL may carry a password: it is never logged or put in an error (libpq's
  ``PGPASSWORD`` keeps it out of the URL altogether).
"""

from __future__ import annotations

import hashlib
import os
import select
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pipeline.release.lock import LockTimeout

TABLE = "aerie_promotion_lease"
_CREATE = (f"CREATE TABLE IF NOT EXISTS {TABLE} (name text PRIMARY KEY, token bigint NOT NULL, "
           f"holder text NOT NULL, acquired_at timestamptz NOT NULL)")
_TAKE = (f"INSERT INTO {TABLE} (name, token, holder, acquired_at) VALUES "
         f"(%s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, %s, clock_timestamp()) "
         f"ON CONFLICT (name) DO UPDATE SET token = greatest({TABLE}.token + 1, EXCLUDED.token),"
         f" holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at RETURNING token")


_CONNECT_TIMEOUT_S = 10
# the server probes an idle lease session after 30 s (TCP keepalives every 10 s, 3 probes),
# so a host that crashed or dropped off the network releases the lease in about a minute
_SERVER_SIDE_PROBES = ("-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 "
                       "-c tcp_keepalives_count=3")


class _Deadline(Exception):
    """The database did not answer within the client's deadline."""


def _wait(conn, timeout_s: float) -> None:
    """Drive the asynchronous ``conn`` until its connection or statement is done, for at
    most ``timeout_s`` (:class:`_Deadline`)."""
    import psycopg2.extensions as ext

    deadline = time.monotonic() + timeout_s
    while True:
        state = conn.poll()
        if state == ext.POLL_OK:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Deadline(f"no answer within {timeout_s:g}s")
        waiting = select.poll()  # not select.select: that refuses descriptors past 1023
        waiting.register(conn.fileno(), select.POLLIN if state == ext.POLL_READ
                         else select.POLLOUT)
        waiting.poll(left * 1000)


def _execute(conn, timeout_s: float, sql: str, args: tuple = ()) -> tuple | None:
    """``sql`` on the asynchronous ``conn`` within ``timeout_s``; its first row, if any."""
    with conn.cursor() as cur:
        cur.execute(sql, args)
        _wait(conn, timeout_s)
        return cur.fetchone() if cur.description is not None else None


def _create_table(conn, timeout_s: float) -> None:
    """The lease table, once per database; a promoter of another model creating it at the
    same moment is no error."""
    import psycopg2

    try:
        _execute(conn, timeout_s, _CREATE)
    except psycopg2.errors.UniqueViolation:  # the concurrent CREATE won: the table is there
        pass


class LeaseUnavailable(ConnectionError):
    """The lease's database could not be reached (retried like any connection error)."""


class LeaseLost(RuntimeError):
    """This holder no longer holds the lease (its database session ended, or the token
    moved on): nothing more may be written under it."""


def redacted(url: str) -> str:
    """``url`` without its password (userinfo or a ``password=`` parameter), for messages
    and reprs; a string that is no URL (a keyword DSN) is not shown at all."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return "<connection string>"
    netloc = parts.netloc
    if parts.password is not None:
        host = parts.hostname or ""
        netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    query = "&".join("password=***" if p.lower().startswith("password=") else p
                     for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def advisory_key(name: str) -> int:
    """A signed 64-bit advisory-lock key for ``name`` (stable across hosts and runs)."""
    digest = hashlib.sha256(f"aerie-promotion:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresLease:
    """``with PostgresLease(url, name) as lease:`` holds the promotion lease of ``name``;
    ``lease.token`` is its fencing token and ``with lease.fenced():`` guards each write."""

    def __init__(self, url: str, name: str, *, timeout_s: float = 120.0, poll_s: float = 0.05,
                 holder: str | None = None, io_timeout_s: float = 30.0):
        self.url = url
        self.name = name
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.io_timeout_s = io_timeout_s
        self.holder = holder or f"{socket.gethostname()} pid {os.getpid()}"
        self.token: int | None = None
        self._conn = None

    def __repr__(self) -> str:
        return f"PostgresLease({self.name!r}, {redacted(self.url)!r}, token={self.token})"

    def acquire(self) -> None:
        import psycopg2

        if self._conn is not None:
            raise RuntimeError(f"the promotion lease of {self.name} is already held here")
        conn = None
        try:
            conn = psycopg2.connect(self.url, connect_timeout=_CONNECT_TIMEOUT_S, async_=True,
                                    application_name="aerie-promotion-lease",
                                    keepalives=1, keepalives_idle=30, keepalives_interval=10,
                                    keepalives_count=3, options=_SERVER_SIDE_PROBES)
            # asynchronous (every statement autocommits): libpq's connect_timeout does not
            # apply, this wait does
            _wait(conn, min(_CONNECT_TIMEOUT_S, self.io_timeout_s))
            self._wait_for_advisory_lock(conn)
            if _execute(conn, self.io_timeout_s, "SELECT to_regclass(%s)", (TABLE,))[0] is None:
                _create_table(conn, self.io_timeout_s)
            self.token = int(_execute(conn, self.io_timeout_s, _TAKE,
                                      (self.name, self.holder))[0])
        except (psycopg2.OperationalError, psycopg2.InterfaceError, _Deadline) as e:
            _close(conn)  # ends the session: the advisory lock goes with it
            raise LeaseUnavailable(f"promotion lease of {self.name}: the database at "
                                   f"{redacted(self.url)} did not serve it: {_first_line(e)}"
                                   ) from None
        except BaseException:
            _close(conn)
            raise
        self._conn = conn

    def _wait_for_advisory_lock(self, conn) -> None:
        key = advisory_key(self.name)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if _execute(conn, self.io_timeout_s, "SELECT pg_try_advisory_lock(%s)", (key,))[0]:
                return
            if time.monotonic() >= deadline:
                raise LockTimeout(f"the promotion lease of {self.name} is held by "
                                  f"{self._holder_now(conn)} (waited {self.timeout_s}s)")
            time.sleep(self.poll_s)

    def _holder_now(self, conn) -> str:
        import psycopg2

        try:
            row = _execute(conn, self.io_timeout_s,
                           f"SELECT holder, token, acquired_at FROM {TABLE} WHERE name = %s",
                           (self.name,))
        except (psycopg2.Error, _Deadline):
            return "another promoter"
        return f"{row[0]} (token {row[1]}, since {row[2]:%Y-%m-%d %H:%M:%S %Z})" if row \
            else "another promoter"

    @contextmanager
    def fenced(self) -> Iterator[None]:
        """Run the body (one write) only while this holder still holds the lease: its
        session alive and the token still its own; :class:`LeaseLost` otherwise."""
        import psycopg2

        if self._conn is None or self.token is None:
            raise LeaseLost(f"the promotion lease of {self.name} is not held here")
        try:
            row = _execute(self._conn, self.io_timeout_s,
                           f"SELECT token FROM {TABLE} WHERE name = %s", (self.name,))
        except _Deadline as e:
            self.release()  # a session that stopped answering is given up, lock and all
            raise LeaseLost(f"the promotion lease of {self.name} (token {self.token}) could "
                            f"not be checked: the database gave {e}, so nothing more is "
                            f"written") from None
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            self.release()  # the session is gone: nothing is held here any more
            raise LeaseLost(f"the promotion lease of {self.name} (token {self.token}) was "
                            f"lost: its database session ended ({_first_line(e)}); another "
                            f"promoter may hold it now, so nothing more is written") from None
        except psycopg2.Error as e:
            raise LeaseLost(f"the promotion lease of {self.name} (token {self.token}) could "
                            f"not be checked ({_first_line(e)}), so nothing more is "
                            f"written") from None
        if row is None or int(row[0]) != self.token:
            raise LeaseLost(f"the promotion lease of {self.name} moved from token "
                            f"{self.token} to {row[0] if row else 'nothing'}: another "
                            f"promoter holds it, so nothing more is written")
        yield

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # the session ends and its advisory lock with it

    @property
    def held(self) -> bool:
        return self._conn is not None

    def __enter__(self) -> PostgresLease:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def fenced(target: Any, lease: PostgresLease, writes: Iterable[str], **bound: Any) -> Any:
    """``target`` with each method named in ``writes`` run inside ``lease.fenced()`` (and
    given the keyword arguments ``bound``); everything else is ``target``'s own."""
    return _Fenced(target, lease, frozenset(writes), bound)


class _Fenced:
    def __init__(self, target: Any, lease: PostgresLease, writes: frozenset[str],
                 bound: dict[str, Any]):
        self._target, self._lease, self._writes, self._bound = target, lease, writes, bound

    def __repr__(self) -> str:
        return f"fenced({self._target!r}, token={self._lease.token})"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._writes:
            return attr

        def write(*args: Any, **kwargs: Any) -> Any:
            with self._lease.fenced():
                return attr(*args, **self._bound, **kwargs)
        return write


def _close(conn) -> None:
    if conn is not None:
        conn.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
