"""Slow and idle clients on a real uvicorn server: a connection that sends nothing or half a
request head is closed after the header timeout; at the connection cap a new client closes
the oldest idle connection, and is refused with a JSON 429 only when every connection is busy.

Raw sockets play the slow clients; every wait is on the server's own action (a closed socket,
a ``100 Continue``), never a sleep.
"""

from __future__ import annotations

import json
import socket
from typing import Iterator

import pytest

from .conftest import LiveServer, server_settings


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_model_dir, index_dir) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("guarded")
    s = server_settings(tmp, tiny_model_dir, index_dir, backend="torch", header_timeout_s=0.3,
                        max_connections=4)
    with LiveServer(s) as srv:
        yield srv


def _connect(srv: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes the connection (True) or 30 s pass (socket.timeout)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _busy(srv: LiveServer) -> socket.socket:
    """A connection with a request running: head sent, body promised but not sent. The server's
    ``100 Continue`` (sent when the app starts reading the body) proves the request has begun."""
    sock = _connect(srv)
    sock.sendall(b"POST /v1/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\nexpect: 100-continue\r\n\r\n")
    assert sock.recv(1024).startswith(b"HTTP/1.1 100")
    return sock


def test_silent_and_half_sent_connections_are_closed(guarded):
    silent = _connect(guarded)
    half = _connect(guarded)
    half.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")   # the head never ends
    kept = _connect(guarded)
    kept.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /healthz HTTP/1.1\r\n")                 # then a next request that stalls
    try:
        assert _closed_by_server(silent) and _closed_by_server(half) and _closed_by_server(kept)
    finally:
        for s in (silent, half, kept):
            s.close()


def test_at_the_cap_the_oldest_idle_connection_makes_room_and_busy_ones_do_not(guarded):
    idle = [_connect(guarded) for _ in range(4)]   # the cap: 4 open connections
    try:
        with guarded.client() as c:                    # a fifth, normal client is served...
            assert c.get("/healthz").status_code == 200
        assert _closed_by_server(idle[0])              # ...by closing the oldest idle connection
    finally:
        for s in idle:
            s.close()
    busy = [_busy(guarded) for _ in range(4)]
    try:
        extra = _connect(guarded)
        data = b""
        while chunk := extra.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"] == "overloaded"
        extra.close()
    finally:
        for s in busy:
            s.close()
    with guarded.client() as c:   # the busy ones gone, it serves again
        assert c.get("/healthz").status_code == 200
