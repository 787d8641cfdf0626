"""The server's own guard: a real uvicorn server, a real index, sentinels over it, real encoders."""

from __future__ import annotations

import pytest

from .conftest import ADMIN, LiveServer, server_settings
from .guarding import GuardGate, build_guard_data, save_bias, wait_verdict as _wait_verdict

@pytest.fixture(scope="module")
def guard_data(tmp_path_factory, tiny_base):
    return build_guard_data(tmp_path_factory.mktemp("guarded"), tiny_base)


@pytest.fixture(scope="module")
def guarded(guard_data, tiny_model_dir):
    d = guard_data
    s = server_settings(d["tmp"], tiny_model_dir, d["index"], encoders_root=d["root"], admin_token=ADMIN,
                        sentinels=d["sentinels"])
    with LiveServer(s) as srv:
        with srv.client(ADMIN) as c:
            yield srv, c


def test_overtuned_encoder_is_refused_on_the_servers_own_evaluation(guarded):
    srv, c = guarded
    r = c.post("/v1/encoders", json={"path": "bad1"})
    assert r.status_code == 202, r.text
    assert r.json()["encoder"]["guard_status"] == "evaluating"
    assert r.headers["location"] == "/v1/encoders/bad@1"
    info = _wait_verdict(srv, c, "bad@1")
    assert info["guard_status"] == "refused", info
    assert info["guard"]["passed"] is True          # its own claim, kept but not believed
    ev = info["evaluation"]
    assert ev["source"] == "server" and ev["passed"] is False and ev["against"] == ["base"]
    rows = {(x["name"], x["against"]): x for x in ev["checks"]}
    assert set(rows) == {("alpha", "base"), ("beta", "base")}
    for x in rows.values():
        assert x["n"] == 80 and x["after"] < x["before"] and x["verdict"] == "regressed", x
        assert x["p_holm"] < 0.05 and x["losses"] > x["wins"] and x["pnd"]["pairs"] > 0
    # Fails closed: not served by name, not aliasable (409 with the table) unless forced.
    r = c.post("/v1/search", json={"query": "chess game", "encoder": "bad@1"})
    assert r.status_code == 409 and r.json()["error"] == "guard_refused", r.text
    r = c.put("/v1/aliases/games", json={"encoder": "bad@1"})
    assert r.status_code == 409 and r.json()["error"] == "guard_refused"
    assert {x["name"] for x in r.json()["guard"]["checks"]} == {"alpha", "beta"}
    assert "games" not in c.get("/v1/aliases").json()["aliases"]
    # Registering the same files again without force is refused the same way.
    r = c.post("/v1/encoders", json={"path": "bad1"})
    assert r.status_code == 409 and r.json()["error"] == "guard_refused"
    metrics = c.get("/metrics").text
    assert 'qswap_guard_regressed{against="base",encoder="bad@1",sentinel="alpha"} 1.0' in metrics
    assert 'qswap_guard_passed{encoder="bad@1"} 0.0' in metrics
    # force accepts it (it is then served by name); the verdict stays on record.
    r = c.post("/v1/encoders", json={"path": "bad1", "force": True})
    assert r.status_code == 200 and r.json()["encoder"]["forced"] is True
    assert c.post("/v1/search", json={"query": "chess game", "encoder": "bad@1"}).status_code == 200
    assert c.get("/v1/encoders/bad@1").json()["guard_status"] == "refused"
    assert c.delete("/v1/encoders/bad@1").status_code == 200
    assert not [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("qswap_guard") and "bad@1" in ln]


def test_waiting_registration_answers_409_with_the_table_and_keeps_nothing(guarded):
    srv, c = guarded
    r = c.post("/v1/encoders", json={"path": "bad2", "wait": True})
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "guard_refused" and body["guard"]["passed"] is False
    assert all(x["verdict"] == "regressed" for x in body["guard"]["checks"])
    assert c.get("/v1/encoders/bad@2").status_code == 404
    assert "bad@2" not in [e["key"] for e in c.get("/v1/encoders").json()["encoders"]]


def test_identity_and_unrecorded_encoders_are_evaluated_and_pass(guarded):
    srv, c = guarded
    r = c.post("/v1/encoders", json={"path": "ident1", "wait": True})
    assert r.status_code == 201, r.text
    info = r.json()["encoder"]
    assert info["guard"] is None and info["guard_status"] == "passed"     # no record: evaluated, not waved through
    checks = info["evaluation"]["checks"]
    assert len(checks) == 2 and all(x["n"] == 80 and x["wins"] == x["losses"] == 0 and x["p_value"] == 1.0
                                    for x in checks)
    assert c.put("/v1/aliases/web", json={"encoder": "ident@1"}).status_code == 200
    # The next encoder is compared with the base and with what it may replace (the aliased one).
    with GuardGate(srv.app.state.qs.guard) as gate:   # holds mild@1 in 'evaluating'
        r = c.post("/v1/encoders", json={"path": "mild1"})
        assert r.status_code == 202
        assert gate.entered.wait(60)
        for force in (False, True):        # nothing accepts a pending encoder, not even force
            r = c.put("/v1/aliases/web", json={"encoder": "mild@1", "force": force})
            assert r.status_code == 409 and r.json()["error"] == "guard_pending", r.text
        assert c.get("/v1/aliases").json()["aliases"]["web"] == "ident@1"
    info = _wait_verdict(srv, c, "mild@1")
    assert info["guard_status"] == "passed", info["evaluation"]
    assert info["evaluation"]["against"] == ["base", "ident@1"]
    assert {(x["name"], x["against"]) for x in info["evaluation"]["checks"]} == {
        ("alpha", "base"), ("beta", "base"), ("alpha", "ident@1"), ("beta", "ident@1")}
    assert c.put("/v1/aliases/web", json={"encoder": "mild@1"}).status_code == 200
    assert c.post("/v1/search", json={"query": "chess", "domain": "web"}).json()["results"][0]["encoder"]["key"] \
        == "mild@1"


def _encoded_rows(c) -> float:
    line = next(ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("qswap_batch_size_sum"))
    return float(line.split()[-1])


def test_guard_forward_passes_go_through_the_batch_worker(guarded, guard_data, tiny_base):
    # The cost gate covers guard evaluations: the new encoder's sentinel queries are batch-worker
    # jobs (counted in its batches, interleaved with searches), not a forward pass beside it.
    srv, c = guarded
    save_bias(guard_data["root"], "gated1", "gated", "1", tiny_base, 1e-4, seed=5)
    before = _encoded_rows(c)
    r = c.post("/v1/encoders", json={"path": "gated1", "wait": True})
    assert r.status_code == 201, r.text
    # the new encoder's queries (the references' embeddings are cached from earlier evaluations)
    sentinel_queries = sum({x["name"]: x["n"] for x in r.json()["encoder"]["evaluation"]["checks"]}.values())
    assert sentinel_queries > 0
    assert _encoded_rows(c) - before >= sentinel_queries
    assert c.delete("/v1/encoders/gated@1").status_code == 200


def test_sentinels_with_unknown_documents_start_and_judge_nothing(tmp_path, tiny_model_dir, index_dir, caplog,
                                                                  guard_data):
    """A sentinel whose judged documents are not in the index does not stop the server: it starts
    with a warning, and every verdict is 'insufficient_evidence' (never 'passed')."""
    from qswap.beir import write_jsonl, write_qrels
    (tmp_path / "s" / "x" / "qrels").mkdir(parents=True)
    write_jsonl(tmp_path / "s" / "x" / "queries.jsonl", [{"_id": "q1", "text": "chess"}])
    write_qrels(tmp_path / "s" / "x" / "qrels" / "test.tsv", [("q1", "no-such-doc", 1)])
    s = server_settings(tmp_path, tiny_model_dir, index_dir, sentinels=tmp_path / "s", admin_token=ADMIN,
                        encoders_root=guard_data["root"])
    with caplog.at_level("WARNING", logger="qswap.server"), LiveServer(s) as srv, srv.client(ADMIN) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200 and "no-such-doc" not in ready.text
        warned = [r for r in caplog.records if r.getMessage() == "sentinel judgements dropped: documents not in the index"]
        assert warned and warned[0].sentinel == "x" and warned[0].queries_left == 0
        info = _wait_verdict(srv, c, c.post("/v1/encoders", json={"path": "ident1"}).json()["encoder"]["key"])
        assert info["guard_status"] == "insufficient_evidence" and info["evaluation"]["passed"] is False
        assert [(x["n"], x["verdict"]) for x in info["evaluation"]["checks"]] == [(0, "insufficient_evidence")]
        r = c.post("/v1/search", json={"query": "chess", "encoder": "ident@1"})
        assert r.status_code == 409 and "0 judged queries left, needs 20" in r.json()["detail"], r.text


def test_restart_with_sentinels_evaluates_unguarded_encoders(guard_data, tiny_model_dir, tmp_path):
    d = guard_data
    # read-only: the module's other server holds the index for writing
    plain = server_settings(tmp_path, tiny_model_dir, d["index"], encoders_root=d["root"], admin_token=ADMIN,
                            read_only_index=True)
    with LiveServer(plain) as srv, srv.client(ADMIN) as c:
        r = c.post("/v1/encoders", json={"path": "bad1"})          # no sentinels: nothing to test it on
        assert r.status_code == 201 and r.json()["encoder"]["guard_status"] == "unguarded"
        assert c.put("/v1/aliases/games", json={"encoder": "bad@1"}).status_code == 200
    guarded = server_settings(tmp_path, tiny_model_dir, d["index"], encoders_root=d["root"], admin_token=ADMIN,
                              sentinels=d["sentinels"], read_only_index=True)
    with LiveServer(guarded) as srv, srv.client(ADMIN) as c:
        info = _wait_verdict(srv, c, "bad@1")
        assert info["guard_status"] == "refused" and info["evaluation"]["passed"] is False
        # The existing alias keeps serving (a restart must not take a domain down) ...
        r = c.post("/v1/search", json={"query": "chess", "domain": "games"})
        assert r.status_code == 200 and r.json()["results"][0]["encoder"]["key"] == "bad@1"
        # ... but no new alias, and no search by name.
        assert c.put("/v1/aliases/music", json={"encoder": "bad@1"}).status_code == 409
        assert c.post("/v1/search", json={"query": "chess", "encoder": "bad@1"}).status_code == 409
