"""What unauthenticated answers may say: /metrics behind a token when operators want it,
no non-JSON numbers from a manifest in the registry file, no server paths in admin errors."""

from __future__ import annotations

import json
import re

import pytest

from ..encoders.adapters import make_overrides
from .conftest import ADMIN, SEARCH, LiveServer, server_settings

METRICS = "metrics-token-0123456789abcdef"


def _strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("tokens, allowed, refused", [
    ({}, [None], []),                                                          # nothing configured: open
    ({"search_token": SEARCH}, [SEARCH, ADMIN], [None, "x" * 20]),             # follows the search token
    ({"search_token": SEARCH, "metrics_token": METRICS}, [METRICS, ADMIN], [None, SEARCH]),
    ({"metrics_token": METRICS}, [METRICS, ADMIN], [None]),                    # search open, metrics not
])
def test_metrics_are_protected_when_operators_ask(tmp_path, tiny_model_dir, index_dir, tokens, allowed, refused):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, admin_token=ADMIN, read_only_index=True, **tokens)
    with LiveServer(s) as srv:
        for tok in allowed:
            with srv.client(tok) as c:
                r = c.get("/metrics")
                assert r.status_code == 200 and "qswap_ready 1.0" in r.text, (tok, r.text[:200])
        for tok in refused:
            with srv.client(tok) as c:
                r = c.get("/metrics")
                assert r.status_code == 401 and r.json()["error"] == "unauthorized", (tok, r.text)
                assert "qswap_" not in r.text


def test_non_finite_numbers_in_a_manifest_are_refused(tmp_path, tiny_model_dir, index_dir, tiny_base):
    root = tmp_path / "root"
    enc = make_overrides(tiny_base, root / "inf", "inf", "bias", seed=71)
    mf = enc / "manifest.json"
    mf.write_text(re.sub(r'"created_at": [0-9.e+]+', '"created_at": Infinity', mf.read_text()))
    assert "Infinity" in mf.read_text()
    make_overrides(tiny_base, root / "ok", "ok", "bias", seed=72)
    s = server_settings(tmp_path, tiny_model_dir, index_dir, admin_token=ADMIN, encoders_root=root,
                        read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        r = c.post("/v1/encoders", json={"path": "inf"})
        assert r.status_code == 422 and "Infinity is not valid JSON" in r.json()["detail"], r.text
        # The message names the file as the request did, not the server's state dir.
        assert str(tmp_path) not in r.text and "inf/manifest.json" in r.json()["detail"]
        assert c.post("/v1/encoders", json={"path": "ok"}).status_code == 201
    registry = _strict_json((tmp_path / "state" / "registry.json").read_text())
    assert list(registry["encoders"]) == ["ok@1"]


def test_a_failed_load_says_so_without_its_reason(tmp_path, tiny_model_dir):
    """The reason (here: a path) goes to the log; unauthenticated answers only say it failed."""
    bogus = tmp_path / "not-an-index"
    bogus.mkdir()
    srv = LiveServer(server_settings(tmp_path, tiny_model_dir, bogus)).start(wait_ready=False)
    try:
        state = srv.app.state.qs
        state._loader.join(120)
        assert state.load_error and str(tmp_path) in state.load_error     # the real reason, kept for the log
        with srv.client() as c:
            for r in (c.get("/readyz"), c.post("/v1/search", json={"query": "x"})):
                assert r.status_code == 503 and r.json()["error"] == "not_ready", r.text
                assert "failed to load" in r.json()["detail"] and str(tmp_path) not in r.text
    finally:
        srv.stop()
