"""A server under test back at rest: the handshake between the windows of a benchmark.

What one window leaves behind must not be measured in the next: after 1,000 stalled
connections the server still reaps them, after an upsert or an abandoned request work may be
queued. :func:`settle` waits until the server says it is at rest, on its own state rather than
a sleep: no request admitted (``qswap_admitted_requests``), no more open sockets than at rest,
and a short probe of normal searches answered in about the time they took at rest
(:class:`Rest`, measured once on the quiet server). It gives up after a timeout and says what it
was still waiting for: a window measured on a server that never settled is flagged, not
silently compared.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from qswap.bench.load_options import LOAD_HOST
from qswap.bench.processes import http_json
from qswap.errors import InvalidInputError

SETTLE_TIMEOUT_S = 120.0
PROBE_REQUESTS = 10          # sequential normal searches of one probe; their median is compared
PROBE_FACTOR = 1.5           # at rest: probe median within this of the rest median ...
PROBE_SLACK_MS = 5.0         # ... or within this many ms of it (a 10 ms median moves by a few ms)
SOCKET_SLACK = 4             # sockets beyond the rest count still at rest (a probe's own connection)
POLL_S = 0.2


def metric(port: int, name: str) -> float:
    """One unlabelled sample of a qswap server's ``/metrics``.

    Raises:
        InvalidInputError: the server has no such sample.
    """
    _, body = http_json("GET", f"http://{LOAD_HOST}:{port}/metrics", None, timeout=30)
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise InvalidInputError(f"/metrics has no {name}", "is this a qswap server?")


def open_sockets(pid: int) -> int:
    """Sockets process ``pid`` holds open (Linux ``/proc``): listening, client connections, its
    event loop's own pairs."""
    n = 0
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            n += os.readlink(f"{fds}/{fd}").startswith("socket:")
        except OSError:   # closed meanwhile
            pass
    return n


def probe_ms(port: int, path: str, body: Any, n: int = PROBE_REQUESTS) -> float:
    """Median latency (ms) of ``n`` sequential POSTs of ``body`` on one new keep-alive
    connection; inf when one fails."""
    data = json.dumps(body).encode()
    c = http.client.HTTPConnection(LOAD_HOST, port, timeout=30)
    ms = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                return float("inf")
            ms.append((time.perf_counter() - t0) * 1000)
    except (OSError, http.client.HTTPException):
        return float("inf")
    finally:
        c.close()
    return statistics.median(ms)


@dataclass(frozen=True)
class Rest:
    """The server at rest: its open sockets and a probe's median latency."""

    sockets: int
    probe_ms: float

    @classmethod
    def measure(cls, pid: int, port: int, path: str, body: Any) -> "Rest":
        """Measure the quiet server (after its warm-up, nothing else running)."""
        p = probe_ms(port, path, body)
        if p == float("inf"):
            raise InvalidInputError(f"the probe request to {path} failed on the quiet server", "see its log")
        return cls(open_sockets(pid), p)

    def probe_bound_ms(self) -> float:
        """The probe median a server at rest stays within."""
        return max(PROBE_FACTOR * self.probe_ms, self.probe_ms + PROBE_SLACK_MS)


def waiting_for(rest: Rest, *, admitted: float, sockets: int, probe: float | None,
                others_gone: bool = True) -> list[str]:
    """What keeps the server from being at rest (empty: at rest).

    Args:
        rest: the server at rest.
        admitted: requests it holds admitted now.
        sockets: sockets it holds open now.
        probe: the probe's median now (None: not probed yet).
        others_gone: whether every other client (the attacker's process) has ended.
    """
    out = []
    if not others_gone:
        out.append("the other client's process to end")
    if admitted > 0:
        out.append(f"{admitted:g} admitted request(s) to finish")
    if sockets > rest.sockets + SOCKET_SLACK:
        out.append(f"{sockets} open sockets to close (at rest: {rest.sockets})")
    if probe is not None and probe > rest.probe_bound_ms():
        out.append(f"probe median {probe:.1f} ms to come back within {rest.probe_bound_ms():.1f} ms")
    return out


def settle(pid: int, port: int, rest: Rest, path: str, body: Any, *, timeout_s: float = SETTLE_TIMEOUT_S,
           others_gone: Callable[[], bool] = lambda: True) -> dict[str, Any]:
    """Wait until the server is at rest (see the module docstring), at most ``timeout_s``.

    Args:
        pid: the server's process.
        port: its port.
        rest: the server at rest (:meth:`Rest.measure`).
        path: the probe's route (a normal search).
        body: the probe's request.
        timeout_s: how long to wait at most.
        others_gone: whether every other client has ended (checked first).

    Returns:
        ``settled``, ``seconds`` waited, the last ``probe_ms`` and, when it did not settle,
        what it was still ``waiting_for``.
    """
    t0 = time.perf_counter()
    probe = None
    while True:
        state = dict(admitted=metric(port, "qswap_admitted_requests"), sockets=open_sockets(pid))
        left = waiting_for(rest, others_gone=others_gone(), probe=None, **state)
        if not left:   # quiet by its own account: does it answer as fast as at rest?
            probe = probe_ms(port, path, body)
            left = waiting_for(rest, probe=probe, **state)
            if not left:
                return {"settled": True, "seconds": time.perf_counter() - t0, "probe_ms": probe}
        if time.perf_counter() - t0 > timeout_s:
            return {"settled": False, "seconds": time.perf_counter() - t0, "probe_ms": probe, "waiting_for": left}
        time.sleep(POLL_S)   # polling the server's state, not ordering events
