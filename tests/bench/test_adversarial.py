"""``qswap bench adversarial``'s pooling of its rounds (the server runs in the benchmark itself)."""

from __future__ import annotations

from qswap.bench.adversarial import pooled, round_ratios
from qswap.bench.stats import percentile


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
