"""The load generator against a tiny local asyncio HTTP server that counts what it receives."""

from __future__ import annotations

import asyncio
import json

import pytest

from qswap.bench.loadgen import Request, check_loopback, run_load, throughput_over_time
from qswap.errors import InvalidInputError


class CountingServer:
    """HTTP/1.1 keep-alive server: counts requests, answers JSON with the running count.

    Every ``fail_every``-th request gets a 500; every ``chunk_every``-th response is chunked;
    every ``close_every``-th response carries ``Connection: close`` and closes the socket.
    """

    def __init__(self, delay_s: float = 0.0, fail_every: int = 0, chunk_every: int = 0, close_every: int = 0):
        self.count = 0
        self.bodies: list[bytes] = []
        self.connections = 0
        self.delay_s, self.fail_every, self.chunk_every, self.close_every = delay_s, fail_every, chunk_every, close_every

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.decode().split("\r\n")[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                self.count += 1
                n = self.count
                self.bodies.append(body)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                status = 500 if self.fail_every and n % self.fail_every == 0 else 200
                payload = json.dumps({"n": n, "echo": body.decode()}).encode()
                close = bool(self.close_every and n % self.close_every == 0)
                hdr = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                if close:
                    hdr += "Connection: close\r\n"
                if self.chunk_every and n % self.chunk_every == 0:
                    half = len(payload) // 2
                    data = (hdr + "Transfer-Encoding: chunked\r\n\r\n").encode()
                    for part in (payload[:half], payload[half:]):
                        data += f"{len(part):x}\r\n".encode() + part + b"\r\n"
                    data += b"0\r\n\r\n"
                else:
                    data = (hdr + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
                writer.write(data)
                await writer.drain()
                if close:
                    return
        finally:
            writer.close()


async def _with_server(server: CountingServer, coro_fn):
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        return await coro_fn(port)
    finally:
        srv.close()
        await srv.wait_closed()


def test_count_bound_is_exact_and_matches_the_server():
    server = CountingServer(fail_every=7, chunk_every=5, close_every=11)
    reqs = lambda i: Request.post_json("/v1/search", {"i": i}, tag=f"t{i % 3}")  # noqa: E731

    async def go(port):
        return await run_load("127.0.0.1", port, reqs, concurrency=8, max_requests=237, duration_s=30,
                              keep_bodies=True)

    res = asyncio.run(_with_server(server, go))
    assert server.count == 237 == res.sent
    assert res.stopped_by == "count"
    # Each index sent exactly once, and the server saw exactly those bodies.
    assert [s.index for s in res.samples] == list(range(237))
    assert sorted(json.loads(b)["i"] for b in server.bodies) == list(range(237))
    assert res.statuses() == {200: 237 - 237 // 7, 500: 237 // 7}
    assert res.failed == 237 // 7 and len(res.ok) == 237 - 237 // 7
    # Chunked and length-delimited bodies both decode, and echo what was sent.
    for s in res.samples:
        d = json.loads(s.body)
        assert json.loads(d["echo"])["i"] == s.index
        assert s.tag == f"t{s.index % 3}"
    # Connection: close made the client reconnect (a worker whose last response closed may
    # have no request left, so up to 8 closes are not followed by a new connection).
    assert 8 + 237 // 11 - 8 <= server.connections <= 8 + 237 // 11
    assert server.connections > 8
    assert res.errors() == {}


def test_time_bound_stops_sending_and_counts_match():
    server = CountingServer(delay_s=0.01)

    async def go(port):
        return await run_load("127.0.0.1", port, [Request("GET", "/x")], concurrency=4, max_requests=10**6,
                              duration_s=0.3)

    res = asyncio.run(_with_server(server, go))
    assert res.stopped_by == "time"
    assert res.sent == server.count
    assert 4 <= res.sent < 4 * 0.3 / 0.01 + 8
    assert res.elapsed_s < 1.0
    assert all(s.latency_s >= 0.009 for s in res.samples)
    tp = throughput_over_time(res, 0.1)
    assert sum(tp.counts) + sum(tp.failures) == res.sent


def test_connection_refused_is_a_failed_sample_not_a_crash():
    async def go():
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        return await run_load("127.0.0.1", port, [Request("GET", "/")], concurrency=2, max_requests=6,
                              duration_s=5)

    res = asyncio.run(go())
    assert res.sent == 6 and res.failed == 6 and res.statuses() == {0: 6}
    assert sum(res.errors().values()) == 6


def test_summary_percentiles_come_from_the_samples():
    server = CountingServer()

    async def go(port):
        return await run_load("127.0.0.1", port, [Request("GET", "/")], concurrency=1, max_requests=20,
                              duration_s=10)

    res = asyncio.run(_with_server(server, go))
    s = res.summary()
    lat = sorted(res.latencies_ms())
    assert s["ok"] == 20 and s["latency_ms"]["n"] == 20
    assert s["latency_ms"]["max"] == pytest.approx(lat[-1])
    assert lat[0] <= s["latency_ms"]["p50"] <= s["latency_ms"]["p99"] <= lat[-1]


@pytest.mark.parametrize("host", ["10.0.0.1", "example.com", "0.0.0.0", "192.168.1.5"])
def test_non_loopback_targets_are_refused(host):
    with pytest.raises(InvalidInputError):
        check_loopback(host)
    with pytest.raises(InvalidInputError):
        asyncio.run(run_load(host, 80, [Request("GET", "/")], concurrency=1, max_requests=1, duration_s=1))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_targets_are_allowed(host):
    assert check_loopback(host) == host


def test_unbounded_runs_are_refused():
    with pytest.raises(InvalidInputError):
        asyncio.run(run_load("127.0.0.1", 1, [Request("GET", "/")], concurrency=1, max_requests=0, duration_s=1))


def test_should_stop_ends_the_run_and_on_response_sees_every_sample():
    server = CountingServer(delay_s=0.002)
    seen = []

    async def go(port):
        return await run_load("127.0.0.1", port, [Request("GET", "/")], concurrency=3, max_requests=10**6,
                              duration_s=30, on_response=seen.append, should_stop=lambda: len(seen) >= 25)

    res = asyncio.run(_with_server(server, go))
    assert res.stopped_by == "signal"
    assert 25 <= res.sent <= 25 + 3 and res.sent == server.count == len(seen)
    assert sorted(s.index for s in seen) == list(range(res.sent))


def test_interval_paces_the_run_at_a_steady_rate():
    server = CountingServer()

    async def go(port):
        return await run_load("127.0.0.1", port, [Request("GET", "/x")], concurrency=4, max_requests=10,
                              duration_s=30, interval_s=0.05)

    res = asyncio.run(_with_server(server, go))
    assert res.sent == server.count == 10
    # request i is not sent before i x 50 ms (an unpaced run of 10 takes a few ms)
    assert all(s.start_s >= s.index * 0.05 for s in res.samples)
    assert res.elapsed_s >= 9 * 0.05
