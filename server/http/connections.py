"""Connections that cost nothing they do not use: header timeout, connection caps, uvicorn config.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but never one that sends
nothing, or half a request head, after it connects: 1,000 of those held 1,000 file
descriptors until the process ran out (EMFILE) and normal clients failed. The protocol here
(uvicorn's own, subclassed) closes a connection that has not delivered a complete request
head within ``header_timeout_s`` of opening or of the first byte of its next request, and caps open
connections below the process's open-file limit: at the cap, a new connection first closes the
idle one (no request running; one that was never served first, then the oldest); only when
every connection is busy is it refused.

One client address may hold at most ``max_per_address`` of those connections: beyond that a new
one from it is answered a JSON 429 and closed in ``connection_made``, before uvicorn sets up its
parser and timers, and never evicts other clients' connections at the cap. While an address
holds its share, the listening socket's filter drops its connection attempts in the kernel
(:mod:`qswap.server.http.synfilter`): a client that reopens every refused connection at once
would otherwise have the event loop accept and close as fast as it can connect.

Finding that idle connection costs O(1) in the usual case: connections that never completed a
request are kept in opening order, so a flood of slow clients at the cap (each new one evicting
another) does not scan every open connection on the event loop per accept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

import uvicorn

from qswap.server.http.errors import error_body
from qswap.server.http.synfilter import SynFilter

log = logging.getLogger("qswap.server")

# File descriptors kept for everything that is not a client connection: index and model
# files, SQLite, ONNX exports, the registry, logs, threads' pipes.
FD_RESERVE_MIN = 128


def _refusal(detail: str = "too many open connections") -> bytes:
    body = json.dumps(error_body("overloaded", detail,
                                 "retry after the Retry-After seconds, or reuse connections (keep-alive)")).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_REFUSAL = _refusal()
_REFUSAL_ADDRESS = _refusal("too many open connections from this address")


def default_max_connections() -> int:
    """Client connections the open-file limit leaves room for (RLIMIT_NOFILE minus a reserve).

    Returns:
        The soft limit minus max(128, a quarter of it), at least 16.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, soft - max(FD_RESERVE_MIN, soft // 4))


def _base_protocol() -> type[asyncio.Protocol]:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:   # httptools is optional in uvicorn: its pure-Python h11 parser then
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def _idle(conn: Any) -> bool:
    """No request in progress: between requests, or its request head not yet complete."""
    cycle = getattr(conn, "cycle", None)
    return cycle is None or cycle.response_complete


def _evict_one(unserved: "OrderedDict[Any, None]", connections: Any, me: Any) -> bool:
    """Close one idle connection other than ``me``: a slow client's (never served) first, oldest
    first, found without a scan in the common case (a busy one, its first request running, is
    skipped); else the oldest kept-alive idle one. False when every connection is busy."""
    for c in unserved:
        if c is not me and _idle(c) and not c.transport.is_closing():
            unserved.pop(c)
            c.transport.close()
            return True
    idle = [c for c in connections if c is not me and _idle(c)]
    if not idle:
        return False
    victim = min(idle, key=lambda c: (getattr(c, "_served", 0) > 0, getattr(c, "_opened", 0.0)))
    victim.transport.close()
    return True


def default_max_per_address(max_connections: int) -> int:
    """Connections one client address may hold by default: a quarter of the cap (at least 8)."""
    return max(8, max_connections // 4)


def _peer_address(transport: asyncio.Transport) -> str | None:
    """The client's IP address (None for a non-IP socket)."""
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) else None


class _Shares:
    """Open connections per client address, at most ``limit`` each (0: no limit); one event loop,
    no lock. An address at its limit is blocked in the kernel (:class:`SynFilter`, once the
    server's listening sockets are watched); refusals are logged at most every ``LOG_EVERY_S``
    (a client refused in a loop must not cost a log line per connection)."""

    LOG_EVERY_S = 10.0

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}
        self.syn = SynFilter()
        self.refused = 0
        self._logged_at = -self.LOG_EVERY_S

    def admit(self, address: str | None, transport: asyncio.Transport) -> bool:
        """Count a new connection from ``address``; when it holds its share, answer 429 and close
        ``transport`` instead (nothing counted) and return False."""
        if address is None:
            return True
        held = self.held.get(address, 0)
        if self.limit and held >= self.limit:
            self._note(address)
            transport.write(_REFUSAL_ADDRESS)
            transport.close()
            return False
        self.held[address] = held + 1
        if held + 1 == self.limit:
            self.syn.block(address)
        return True

    def release(self, address: str | None) -> None:
        """One of ``address``'s connections closed."""
        if address is None:
            return
        left = self.held[address] - 1
        if left == self.limit - 1:
            self.syn.unblock(address)
        if left:
            self.held[address] = left
        else:
            del self.held[address]

    def _note(self, address: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY_S:
            self._logged_at = now
            log.warning("connections refused: too many from one address",
                        extra={"address": address, "max_connections_per_address": self.limit,
                               "refused_so_far": self.refused})


def guarded_protocol(header_timeout_s: float, max_connections: int,
                     max_per_address: int = 0) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a request-head timeout and connection caps.

    Args:
        header_timeout_s: seconds a connection may take to deliver a complete request head,
            from when it opens or (kept alive) from the first byte of its next request.
        max_connections: open client connections at most.
        max_per_address: open connections from one client address at most (0: no limit).

    Returns:
        A protocol class for ``uvicorn.Config(http=...)``.
    """
    base: Any = _base_protocol()
    # Open connections that never completed a request, oldest first (one event loop: no lock).
    unserved: OrderedDict[Any, None] = OrderedDict()
    shares = _Shares(max_per_address)   # its filter watches the listening sockets once started

    class GuardedProtocol(base):   # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _opened: float = 0.0
        _served = 0
        _address: str | None = None
        _refused = False
        syn_filter = shares.syn

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            address = _peer_address(transport)
            if not shares.admit(address, transport):   # before uvicorn's setup: an accept and a close
                self._refused = True
                return
            self._address = address
            super().connection_made(transport)
            self._opened = time.monotonic()
            unserved[self] = None
            if len(self.connections) > max_connections and not _evict_one(unserved, self.connections, self):
                log.warning("connection refused: every connection is busy",
                            extra={"connections": len(self.connections), "max_connections": max_connections})
                transport.write(_REFUSAL)
                transport.close()
                return
            self._arm()   # a new connection must send a request head within the bound

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if _idle(self) and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            # The first bytes of a request on a kept-alive connection start its head's clock
            # (until then uvicorn's keep-alive timeout applies).
            if self._header_timer is None and _idle(self):
                self._arm()
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._served += 1
            unserved.pop(self, None)
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return   # uvicorn never saw it
            shares.release(self._address)
            self._disarm()
            unserved.pop(self, None)
            super().connection_lost(exc)

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def uvicorn_config(app: Any, settings: Any, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration of a qswap server: one worker, the connection limits above.

    Args:
        app: the ASGI app (:func:`qswap.server.http.app.create_app`).
        settings: its :class:`~qswap.server.config.ServerSettings`.
        overrides: further ``uvicorn.Config`` arguments (tests pass ``lifespan``).

    Returns:
        The config for :class:`qswap.server.http.app.DrainingServer`.
    """
    cap = settings.max_connections or default_max_connections()
    per_address = settings.max_connections_per_address
    if per_address is None:
        per_address = default_max_per_address(cap)
    kw: dict[str, Any] = dict(
        host=settings.host, port=settings.port, workers=1, loop="auto",
        http=guarded_protocol(settings.header_timeout_s, cap, per_address), access_log=False, log_config=None,
        server_header=False, timeout_keep_alive=settings.keep_alive_timeout_s,
        timeout_graceful_shutdown=settings.shutdown_timeout_s, backlog=settings.backlog)
    kw.update(overrides)
    return uvicorn.Config(app, **kw)
