"""Metrics.child: the cached series are the ones ``labels`` gives, and what they count is exported."""

from __future__ import annotations

from qswap.server.http.metrics import Metrics


def test_child_is_the_labelled_series_and_counts_into_the_export():
    m = Metrics()
    c = m.child(m.requests, "/v1/search", "POST", "200")
    assert c is m.child(m.requests, "/v1/search", "POST", "200")
    assert c is m.requests.labels(route="/v1/search", method="POST", status="200")
    c.inc()
    m.child(m.requests, "/v1/search", "POST", "422").inc(2)
    m.child(m.request_seconds, "/v1/search", "d0@1").observe(0.003)
    text = m.render()[0].decode()
    assert 'qswap_requests_total{method="POST",route="/v1/search",status="200"} 1.0' in text
    assert 'qswap_requests_total{method="POST",route="/v1/search",status="422"} 2.0' in text
    assert 'qswap_request_duration_seconds_count{encoder="d0@1",route="/v1/search"} 1.0' in text
