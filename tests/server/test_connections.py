"""Slow and idle clients on a real uvicorn server: a connection that sends nothing or half a
request head is closed after the header timeout; at the connection cap a new client closes
the oldest idle connection, and is refused with a JSON 429 only when every connection is busy;
one address holds at most its share of connections.

Raw sockets play the slow clients; every wait is on the server's own action (a closed socket,
a ``100 Continue``), never a sleep.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Iterator

import httpx
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


def _answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """Everything the server sends until it closes: (head, body)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def test_one_address_holds_at_most_its_share_of_connections(tmp_path, tiny_model_dir, index_dir):
    """Beyond max_connections_per_address, a new connection from the same address is answered
    429 and closed at once; another address is served meanwhile; a closed connection frees its
    slot."""
    s = server_settings(tmp_path, tiny_model_dir, index_dir, backend="torch", max_connections_per_address=2,
                        read_only_index=True)
    with LiveServer(s) as srv:
        held = [_busy(srv) for _ in range(2)]   # 127.0.0.1's two connections, requests running
        try:
            extra = _connect(srv)
            head, body = _answer(extra)
            extra.close()
            assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in head.lower()
            assert json.loads(body)["error"] == "overloaded" and "this address" in json.loads(body)["detail"]
            _served_from_another_address(srv)
        finally:
            for sock in held:
                sock.close()
        connections = srv.server.server_state.connections
        deadline = time.monotonic() + 30
        while connections and time.monotonic() < deadline:   # the server sees the two go
            time.sleep(0.01)
        with srv.client() as c:
            assert c.get("/healthz").status_code == 200


def test_the_kernel_drops_connection_attempts_from_an_address_at_its_share(tmp_path, tiny_model_dir, index_dir):
    """On the server ``qswap serve`` runs (DrainingServer), an address that holds its share has
    its connection attempts dropped by the listening socket's filter (no accept, no close:
    the connect does not complete) until one of its connections closes; other addresses
    connect meanwhile."""
    import threading

    from qswap.server.http.app import DrainingServer

    s = server_settings(tmp_path, tiny_model_dir, index_dir, backend="torch", max_connections_per_address=2,
                        read_only_index=True)
    srv = LiveServer(s)
    srv.server = DrainingServer(srv.server.config)
    srv.thread = threading.Thread(target=srv.server.run, kwargs={"sockets": [srv.sock]}, daemon=True)
    with srv:
        syn = srv.server.config.http_protocol_class.syn_filter
        assert syn.active
        held = [_busy(srv) for _ in range(2)]
        try:
            assert syn.blocked == ["127.0.0.1"]
            with pytest.raises(TimeoutError):   # the SYN is dropped: no connection, nothing accepted
                socket.create_connection(("127.0.0.1", srv.port), timeout=0.5).close()
            _served_from_another_address(srv)
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 30
        while syn.blocked and time.monotonic() < deadline:   # the server sees one of the two go
            time.sleep(0.01)
        assert syn.blocked == []
        with srv.client() as c:
            assert c.get("/healthz").status_code == 200


def _served_from_another_address(srv: LiveServer) -> None:
    """A client at 127.0.0.2 (another address than the tests' 127.0.0.1) is served meanwhile."""
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=srv.url, transport=other, timeout=30) as c:
        assert c.get("/healthz").status_code == 200
