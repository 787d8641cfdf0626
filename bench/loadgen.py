"""A closed-loop HTTP/1.1 load generator on raw asyncio streams, for loopback servers only.

Why not httpx: its per-request overhead caps one Python process near 700 requests/s on this
kind of machine, so the client, not the server, would be measured. Here each of
``concurrency`` workers owns one keep-alive connection and sends its next request as soon
as the previous response has been read in full (closed loop). Request ``i`` (0, 1, 2, ...)
comes from ``make_request(i)``, so traffic mixes are deterministic.

A run is bounded twice: at most ``max_requests`` are sent and none is started after
``duration_s``; requests in flight at the deadline are finished (each bounded by
``timeout_s``). Targets must be loopback addresses (127.0.0.1, ::1, localhost): this tool
is for measuring a local server, never for loading someone else's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qswap.errors import InvalidInputError

LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class Request:
    """One HTTP request: method, path (with query string), body and extra headers."""

    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    tag: str = ""   # free label carried into the sample (e.g. the encoder a request used)

    @classmethod
    def post_json(cls, path: str, obj: Any, tag: str = "") -> "Request":
        return cls("POST", path, json.dumps(obj).encode(), (("Content-Type", "application/json"),), tag)


@dataclass
class Sample:
    """What happened to one request: when it started (s since the run began), how long it took."""

    index: int
    start_s: float
    latency_s: float
    status: int            # 0 when no response arrived (connection error or timeout)
    error: str = ""
    tag: str = ""
    body: bytes | None = None


@dataclass
class LoadResult:
    """All samples of a run plus its wall time; ``ok`` means a 2xx response."""

    samples: list[Sample]
    elapsed_s: float
    concurrency: int
    stopped_by: str        # "count", "time" or "signal"

    @property
    def sent(self) -> int:
        return len(self.samples)

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if 200 <= s.status < 300]

    @property
    def failed(self) -> int:
        return sum(1 for s in self.samples if not 200 <= s.status < 300)

    @property
    def qps(self) -> float:
        """Successful responses per second of wall time."""
        return len(self.ok) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def statuses(self) -> dict[int, int]:
        return dict(Counter(s.status for s in self.samples))

    def errors(self) -> dict[str, int]:
        return dict(Counter(s.error for s in self.samples if s.error))

    def latencies_ms(self, ok_only: bool = True) -> list[float]:
        return [s.latency_s * 1e3 for s in (self.ok if ok_only else self.samples)]

    def summary(self) -> dict[str, Any]:
        """Counts, QPS and latency percentiles (ms) of the successful requests."""
        from qswap.bench.stats import summarize
        lat = summarize(self.latencies_ms())
        return {"concurrency": self.concurrency, "sent": self.sent, "ok": len(self.ok), "failed": self.failed,
                "statuses": {str(k): v for k, v in sorted(self.statuses().items())}, "errors": self.errors(),
                "elapsed_s": round(self.elapsed_s, 3), "qps": self.qps, "stopped_by": self.stopped_by,
                "latency_ms": lat}


def check_loopback(host: str) -> str:
    """Return ``host`` if it is a loopback address; raise :class:`InvalidInputError` otherwise."""
    if host in LOOPBACK_NAMES:
        return host
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise InvalidInputError(f"load target {host!r} is not a loopback address",
                            "benchmarks load local servers only: use 127.0.0.1")


class HTTPProtocolError(Exception):
    """The server's bytes are not a response this client understands."""


class _Connection:
    """One keep-alive HTTP/1.1 connection, reopened after an error or ``Connection: close``."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        sock = self.writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    def _encode(self, req: Request) -> bytes:
        head = [f"{req.method} {req.path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                f"Content-Length: {len(req.body)}"]
        head += [f"{k}: {v}" for k, v in req.headers]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + req.body

    async def request(self, req: Request) -> tuple[int, bytes]:
        """Send ``req`` and read its whole response: ``(status, body)``."""
        if self.writer is None:
            await self._open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(self._encode(req))
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPProtocolError(f"bad status line {lines[0][:60]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        close = headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0"
        if req.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            body = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        elif "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        else:  # body runs to the end of the connection
            body = await self.reader.read()
            close = True
        if close:
            self.close()
        return status, body

    async def _read_chunked(self) -> bytes:
        assert self.reader is not None
        out = bytearray()
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await self.reader.readuntil(b"\r\n")) != b"\r\n":   # trailers
                    pass
                return bytes(out)
            out += await self.reader.readexactly(size)
            if await self.reader.readexactly(2) != b"\r\n":
                raise HTTPProtocolError("chunk not followed by CRLF")


async def run_load(host: str, port: int, make_request: Callable[[int], Request] | Sequence[Request], *,
                   concurrency: int, max_requests: int, duration_s: float, timeout_s: float = 30.0,
                   keep_bodies: bool = False,
                   on_response: Callable[[Sample], None] | None = None,
                   should_stop: Callable[[], bool] | None = None,
                   interval_s: float | None = None) -> LoadResult:
    """Drive ``concurrency`` keep-alive connections until ``max_requests`` or ``duration_s``.

    ``interval_s`` paces the run at a steady rate: request ``i`` is not sent before
    ``i * interval_s`` seconds into the run (None: each connection sends as fast as it is
    answered). Latency is measured from the actual send.

    ``make_request`` is a function of the request index, or a sequence used round-robin.
    ``keep_bodies`` keeps each response body on its sample (for server-side timings).
    ``on_response`` sees every sample as it completes; ``should_stop`` (checked before each
    request, e.g. a ``threading.Event().is_set``) ends the run early.
    """
    check_loopback(host)
    if concurrency < 1 or max_requests < 1 or duration_s <= 0:
        raise InvalidInputError(
            f"concurrency ({concurrency}), max_requests ({max_requests}) and duration_s ({duration_s}) must be positive",
            "a load run is bounded in both count and time")
    if not callable(make_request):
        reqs = list(make_request)
        if not reqs:
            raise InvalidInputError("no requests to send", "give at least one Request")
        make = lambda i: reqs[i % len(reqs)]  # noqa: E731
    else:
        make = make_request
    samples: list[Sample] = []
    counter = 0
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    stopped = {"by": "count"}

    async def worker() -> None:
        nonlocal counter
        conn = _Connection(host, port)
        try:
            while True:
                # Single-threaded event loop: taking the next index cannot race.
                if counter >= max_requests:
                    return
                if time.perf_counter() >= deadline:
                    stopped["by"] = "time"
                    return
                if should_stop is not None and should_stop():
                    stopped["by"] = "signal"
                    return
                i = counter
                counter += 1
                if interval_s is not None:
                    wait = t0 + i * interval_s - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                req = make(i)
                start = time.perf_counter()
                status, err, body = 0, "", None
                try:
                    status, body = await asyncio.wait_for(conn.request(req), timeout_s)
                except (asyncio.TimeoutError, TimeoutError):
                    err = "timeout"
                    conn.close()
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, HTTPProtocolError,
                        ValueError) as e:
                    err = type(e).__name__
                    conn.close()
                end = time.perf_counter()
                s = Sample(i, start - t0, end - start, status, err, req.tag, body if keep_bodies else None)
                samples.append(s)
                if on_response is not None:
                    on_response(s)
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    samples.sort(key=lambda s: s.index)
    return LoadResult(samples, elapsed, concurrency, stopped["by"])


def run_load_sync(host: str, port: int, make_request: Callable[[int], Request] | Sequence[Request],
                  **kwargs: Any) -> LoadResult:
    """:func:`run_load` in a fresh event loop (uvloop when installed: less client overhead)."""
    coro = run_load(host, port, make_request, **kwargs)
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def sweep(host: str, port: int, make_request: Callable[[int], Request] | Sequence[Request],
          concurrencies: Sequence[int], *, requests_per_level: int, seconds_per_level: float,
          warmup_requests: int = 0, **kwargs: Any) -> list[LoadResult]:
    """One bounded run per concurrency level (each after ``warmup_requests`` discarded ones)."""
    out = []
    for c in concurrencies:
        if warmup_requests:
            run_load_sync(host, port, make_request, concurrency=c, max_requests=warmup_requests,
                          duration_s=seconds_per_level, **kwargs)
        out.append(run_load_sync(host, port, make_request, concurrency=c, max_requests=requests_per_level,
                                 duration_s=seconds_per_level, **kwargs))
    return out


@dataclass
class Throughput:
    """Requests per second over fixed windows of a run (for plots of load over time)."""

    window_s: float
    counts: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)


def throughput_over_time(result: LoadResult, window_s: float = 1.0) -> Throughput:
    """Bucket completions by the window their request started in."""
    n = int(result.elapsed_s // window_s) + 1
    out = Throughput(window_s, [0] * n, [0] * n)
    for s in result.samples:
        b = min(int(s.start_s // window_s), n - 1)
        if 200 <= s.status < 300:
            out.counts[b] += 1
        else:
            out.failures[b] += 1
    return out
