"""A TCP fault proxy on loopback, between Aerie and one service (S3, MLflow, PostgreSQL, an
engine's contract server).

``FaultProxy(upstream_port)`` listens on a free port of 127.0.0.1 and forwards each
connection to ``127.0.0.1:upstream_port``, byte for byte, until a fault is set:

- ``latency``: every chunk, both ways, waits ``delay_s`` first;
- ``reset``: the connection is closed with a TCP reset (``SO_LINGER`` 0) as soon as the
  fault reaches it, before any byte of the answer;
- ``blackhole``: what the client sends is read and dropped, nothing ever comes back (a hung
  server: the client's TCP stack sees a live peer, so keepalives do not notice);
- ``truncate``: the answer is cut after ``after_bytes`` bytes and the connection closed
  cleanly (FIN), as a proxy or a dying server does;
- ``slow``: the answer trickles at ``rate`` bytes per second;
- ``refuse``: the listening socket closes, so connecting is refused, until cleared.

A fault reaches the connections open when it is set as well as new ones (a network fault
does not spare pooled keep-alive connections), and ``count`` limits it to that many
connections, after which the proxy forwards again (a transient fault). ``clear()`` ends it.
Nothing here touches the upstream service itself: restarting one is the campaign's.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

KINDS = ("latency", "reset", "blackhole", "truncate", "slow", "refuse")
_CHUNK = 65536


@dataclass(frozen=True)
class Fault:
    kind: str
    delay_s: float = 0.5  # latency
    after_bytes: int = 64  # truncate
    rate: int = 256  # slow, bytes per second
    count: int | None = None  # connections it reaches; None: all until cleared

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; one of {KINDS}")


class _Link:
    """One proxied connection: the client's socket, the upstream's, and its fault."""

    def __init__(self, client: socket.socket, upstream: socket.socket | None):
        self.client, self.upstream = client, upstream
        self.fault: Fault | None = None
        self.answered = 0  # bytes sent back to the client since the fault reached it
        self.closed = threading.Event()
        self._closing = threading.Lock()

    def close(self, reset: bool = False) -> None:
        with self._closing:  # two threads may close it at once (a pump and set())
            if self.closed.is_set():
                return
            self.closed.set()
            self._close(reset)

    def _close(self, reset: bool) -> None:
        if reset:
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                   struct.pack("ii", 1, 0))
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:  # wakes a pump blocked in recv; SHUT_RD sends nothing, so a reset stays one
                s.shutdown(socket.SHUT_RD if reset and s is self.client else socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class FaultProxy:
    """``proxy.port`` forwards to ``upstream_port``; ``set(Fault(...))``, ``clear()``,
    ``stop()``. ``stats`` counts connections by the fault that reached them."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._left: int | None = None  # connections the fault may still reach
        self._links: set[_Link] = set()
        self._stopped = threading.Event()
        self.stats: dict[str, int] = {}
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept, args=(self._listener,),
                                           daemon=True, name=f"fault-proxy-{self.port}")
        self._accepting.start()

    @property
    def url_host(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- control ------------------------------------------------------------------------
    def set(self, fault: Fault) -> None:
        with self._lock:
            self._fault, self._left = fault, fault.count
            links = list(self._links)
        if fault.kind == "refuse":
            self._close_listener()
            for link in links:
                link.close(reset=True)
            return
        for link in links:
            self._reach(link)

    def clear(self) -> None:
        with self._lock:
            refused = self._fault is not None and self._fault.kind == "refuse"
            self._fault, self._left = None, None
            links = list(self._links)
        for link in links:
            link.fault = None
        if refused and not self._stopped.is_set():
            self._listener = self._listen(self.port)
            threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self._close_listener()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- forwarding ---------------------------------------------------------------------
    def _listen(self, port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    def _close_listener(self) -> None:
        try:  # shutdown first: a bare close leaves the socket listening under accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: stopped or refusing
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _reach(self, link: _Link) -> None:
        """Give ``link`` the current fault if it may still reach one more connection."""
        with self._lock:
            fault = self._fault
            if fault is None or self._left == 0:
                return
            if self._left is not None:
                self._left -= 1
            self.stats[fault.kind] = self.stats.get(fault.kind, 0) + 1
        link.answered = 0
        link.fault = fault
        if fault.kind == "reset":
            link.close(reset=True)

    def _serve(self, client: socket.socket) -> None:
        link = _Link(client, None)
        with self._lock:
            self._links.add(link)
        try:
            self._reach(link)
            if link.closed.is_set():
                return
            if link.fault is None or link.fault.kind != "blackhole":
                try:
                    link.upstream = socket.create_connection(self.upstream, timeout=10)
                    link.upstream.settimeout(None)
                except OSError:
                    link.close(reset=True)  # the service is down: the client sees a reset
                    return
            up = threading.Thread(target=self._pump, args=(link, True), daemon=True)
            up.start()
            self._pump(link, False)
            up.join()
        finally:
            link.close()
            with self._lock:
                self._links.discard(link)

    def _pump(self, link: _Link, to_upstream: bool) -> None:
        """Copy one direction of ``link`` until either side closes, applying its fault."""
        src = link.client if to_upstream else link.upstream
        while not link.closed.is_set():
            if src is None:  # a black-holed link has no upstream: just drain the client
                src = link.client if to_upstream else None
                if src is None:
                    link.closed.wait()
                    return
            try:
                data = src.recv(_CHUNK)
            except OSError:
                break
            if not data:
                break
            if not self._forward(link, data, to_upstream):
                return
        link.close()

    def _forward(self, link: _Link, data: bytes, to_upstream: bool) -> bool:
        """Send ``data`` on under the link's fault; False when the link is done for."""
        fault = link.fault
        kind = fault.kind if fault else None
        if kind == "blackhole":
            return True  # dropped; the answer never comes
        if kind == "latency":
            time.sleep(fault.delay_s)
        dst = link.upstream if to_upstream else link.client
        if dst is None:
            return True
        try:
            if to_upstream or kind not in ("truncate", "slow"):
                dst.sendall(data)
            elif kind == "truncate":
                room = max(0, fault.after_bytes - link.answered)
                dst.sendall(data[:room])
                link.answered += min(room, len(data))
                if link.answered >= fault.after_bytes:
                    link.close()
                    return False
            else:  # slow: a few bytes at a time at fault.rate bytes per second
                step = max(1, fault.rate // 16)
                for i in range(0, len(data), step):
                    if link.closed.is_set() or link.fault is not fault:
                        dst.sendall(data[i:])
                        break
                    dst.sendall(data[i : i + step])
                    time.sleep(step / fault.rate)
        except OSError:
            link.close()
            return False
        return True
