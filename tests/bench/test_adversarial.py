"""``qswap bench adversarial``: the pooling of its rounds, and the settle handshake between windows
(the qswap server runs in the benchmark itself; here a small real HTTP server stands in for its state)."""

from __future__ import annotations

import os
import threading
import time

from qswap.bench.adversarial import pooled, round_ratios
from qswap.bench.load_options import LOAD_HOST
from qswap.bench.settle import SOCKET_SLACK, Rest, settle, waiting_for
from qswap.bench.stats import percentile

from ..local_http import http_server


def _window(lat: list[float], failed: int = 0, attacker: dict | None = None) -> dict:
    out = {"sent": len(lat) + failed, "ok": len(lat), "failed": failed, "statuses": {"200": len(lat)},
           "errors": {"timeout": failed} if failed else {}, "p50_ms": percentile(lat, 50),
           "p99_ms": percentile(lat, 99), "healthz_max_ms": max(lat), "healthz_failed": failed}
    if attacker is not None:
        out["attacker"] = attacker
    return out


def test_rounds_are_pooled_into_one_p99_over_every_request_and_counts_add_up() -> None:
    # Round 1: one 100 ms outlier among 200 requests; round 2: none. One window's p99 is
    # that outlier's neighbourhood; over both rounds it is a rank among 400.
    a = [10.0] * 199 + [100.0]
    b = [12.0] * 200
    att = {"answers": {"abandoned": 3}, "jobs_done": 0, "closed_by_server": 1, "answer_bytes_max": None}
    q = pooled([_window(b), _window(b)], [b, b])
    w = pooled([_window(a, 1, att), _window(b, 0, {**att, "answer_bytes_max": 5})], [a, b])
    assert w["p99_ms"] == percentile(a + b, 99) and w["p99_ms"] != percentile(a, 99)
    assert (w["sent"], w["ok"], w["failed"]) == (401, 400, 1)
    assert w["statuses"] == {"200": 400} and w["errors"] == {"timeout": 1}
    assert w["attacker"]["answers"] == {"abandoned": 6} and w["attacker"]["closed_by_server"] == 2
    assert w["attacker"]["answer_bytes_max"] == 5 and w["healthz_max_ms"] == 100.0
    assert len(w["rounds"]) == 2 and "attacker" not in q
    assert round_ratios(q, w) == [percentile(a, 99) / 12.0, 1.0]


class _State:
    """What the fake server says: how many requests it holds admitted, and whether its search
    answers slowly (the test sets both)."""

    admitted = 0.0
    delay = threading.Event()   # set: the search answers slowly


def _metrics() -> bytes:
    return f"# HELP qswap_admitted_requests x\nqswap_admitted_requests {_State.admitted}\n".encode()


def _search() -> bytes:
    if _State.delay.is_set():
        time.sleep(0.05)   # a slow answer (what is measured), not an ordering
    return b"{}"


def test_settle_waits_on_the_servers_own_state_and_says_what_never_settled() -> None:
    pid, body = os.getpid(), {"query": "q"}
    try:
        with http_server(LOAD_HOST, {("GET", "/metrics"): _metrics, ("POST", "*"): _search},
                     keep_alive=False) as port:
            _State.admitted = 0.0
            rest = Rest.measure(pid, port, "/v1/search", body)
            ok = settle(pid, port, rest, "/v1/search", body, timeout_s=5)
            assert ok["settled"] and ok["probe_ms"] <= rest.probe_bound_ms()
            _State.admitted = 2.0   # work left behind: never at rest
            stuck = settle(pid, port, rest, "/v1/search", body, timeout_s=0.3)
            assert not stuck["settled"] and stuck["waiting_for"] == ["2 admitted request(s) to finish"]
            _State.admitted = 0.0
            gone = settle(pid, port, rest, "/v1/search", body, timeout_s=0.3, others_gone=lambda: False)
            assert not gone["settled"] and gone["waiting_for"] == ["the other client's process to end"]
            _State.delay.set()   # quiet by its own account, but slow: the probe says so
            slow = settle(pid, port, Rest(rest.sockets, 1.0), "/v1/search", body, timeout_s=0.3)
            assert not slow["settled"] and slow["waiting_for"][0].startswith("probe median")
    finally:
        _State.delay.clear()


def test_waiting_for_names_every_reason_the_server_is_not_at_rest() -> None:
    rest = Rest(sockets=10, probe_ms=10.0)
    assert rest.probe_bound_ms() == 15.0 and Rest(10, 4.0).probe_bound_ms() == 9.0
    assert waiting_for(rest, admitted=0, sockets=10 + SOCKET_SLACK, probe=15.0) == []
    left = waiting_for(rest, admitted=1, sockets=11 + SOCKET_SLACK, probe=15.1, others_gone=False)
    assert len(left) == 4 and "admitted" in left[1] and "sockets" in left[2] and "probe" in left[3]
