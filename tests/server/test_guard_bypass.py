"""Every way around the server's guard is closed: the default, force, aliases, a stale verdict,
a newer version blocking a name, sentinels that lost their judged documents, reserved names.

A real uvicorn server over a real index with sentinels; races are ordered by events (the guard
thread is held inside an evaluation, or before it stores a verdict), never by sleeps.
"""

from __future__ import annotations

import shutil
import threading
from typing import Any

import pytest

from qswap.encoders import save_encoder

from .conftest import ADMIN, LiveServer, server_settings
from .guarding import GuardGate, build_guard_data, save_bias, wait_verdict


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_base):
    d = build_guard_data(tmp_path_factory.mktemp("bypass"), tiny_base)
    save_bias(d["root"], "mild3", "mild", "3", tiny_base, 3.0)          # a newer, over-tuned version of mild
    save_bias(d["root"], "staleA", "stale", "1", tiny_base, 1e-4, seed=5)   # harmless ...
    save_bias(d["root"], "staleB", "stale", "1", tiny_base, 3.0, seed=6)    # ... and the same key, over-tuned
    for name in ("BASE", "Default"):
        save_encoder(d["root"] / name, name=name, version="1", kind="identity", space=tiny_base.space)
    return d


@pytest.fixture(scope="module")
def server(data, tiny_model_dir, tmp_path_factory):
    """A guarded server whose configured default encoder is the name ``mild`` (mild@1 passed)."""
    tmp = tmp_path_factory.mktemp("bypass-state")
    kw = dict(encoders_root=data["root"], admin_token=ADMIN, sentinels=data["sentinels"], read_only_index=True)
    with LiveServer(server_settings(tmp, tiny_model_dir, data["index"], **kw)) as srv, srv.client(ADMIN) as c:
        for path in ("mild1", "ident1"):
            assert c.post("/v1/encoders", json={"path": path, "wait": True}).status_code == 201
    s = server_settings(tmp, tiny_model_dir, data["index"], default_encoder="mild", **kw)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        yield srv, c


def _served_by(c: Any, **body: Any) -> str:
    r = c.post("/v1/search", json={"query": "chess game", **body})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["encoder"]["key"]


def test_default_and_names_resolve_to_the_highest_servable_version(server):
    srv, c = server
    assert _served_by(c) == "mild@1" and c.get("/readyz").json()["default_encoder"] == "mild@1"
    with GuardGate(srv.app.state.qs.guard) as gate:
        r = c.post("/v1/encoders", json={"path": "mild3"})
        assert r.status_code == 202 and gate.entered.wait(60)
        # mild@3 is evaluating: neither the default nor the name serve it, both keep serving mild@1.
        assert _served_by(c) == "mild@1"
        assert _served_by(c, encoder="mild") == "mild@1"
        assert c.get("/v1/encoders/mild").json()["key"] == "mild@1"
        r = c.post("/v1/search", json={"query": "chess", "encoder": "mild@3"})
        assert r.status_code == 409 and r.json()["error"] == "guard_pending"
    assert wait_verdict(srv, c, "mild@3")["guard_status"] == "refused"
    assert _served_by(c) == "mild@1" and _served_by(c, encoder="mild") == "mild@1"
    # The refused version is not the default: it can be deleted; the served one cannot.
    assert c.delete("/v1/encoders/mild@1").status_code == 409
    assert c.delete("/v1/encoders/mild@3").status_code == 200
    assert _served_by(c) == "mild@1"


def test_force_never_serves_while_evaluating_and_accepts_a_known_verdict(server):
    srv, c = server
    with GuardGate(srv.app.state.qs.guard) as gate:
        r = c.post("/v1/encoders", json={"path": "bad1", "force": True})
        assert r.status_code == 202 and gate.entered.wait(60)
        enc = r.json()["encoder"]
        assert enc["guard_status"] == "evaluating" and enc["forced"] is True
        r = c.post("/v1/search", json={"query": "chess", "encoder": "bad@1"})
        assert r.status_code == 409 and r.json()["error"] == "guard_pending", r.text
        for force in (False, True):
            r = c.put("/v1/aliases/games", json={"encoder": "bad@1", "force": force})
            assert r.status_code == 409 and r.json()["error"] == "guard_pending", r.text
        assert "games" not in c.get("/v1/aliases").json()["aliases"]
    info = wait_verdict(srv, c, "bad@1")
    assert info["guard_status"] == "refused" and info["forced"] is True
    # Its verdict is known: the force given at registration now lets it serve by name, and says
    # so; an alias is another admin decision, which asks for force again.
    assert _served_by(c, encoder="bad@1") == "bad@1"
    r = c.post("/v1/search", json={"query": "chess", "encoder": "bad@1"})
    assert r.json()["results"][0]["encoder"]["forced"] is True
    r = c.put("/v1/aliases/games", json={"encoder": "bad@1"})
    assert r.status_code == 409 and r.json()["error"] == "guard_refused", r.text
    r = c.put("/v1/aliases/games", json={"encoder": "bad@1", "force": True})
    assert r.status_code == 200 and r.json()["forced"] is True
    listed = {e["key"]: e for e in c.get("/v1/encoders").json()["encoders"]}
    assert listed["bad@1"]["forced"] is True and listed["bad@1"]["guard_status"] == "refused"
    assert 'qswap_guard_passed{encoder="bad@1"} 0.0' in c.get("/metrics").text
    assert c.delete("/v1/aliases/games").status_code == 200
    assert c.delete("/v1/encoders/bad@1").status_code == 200


def test_alias_force_accepts_a_refused_verdict_and_records_it(server):
    srv, c = server
    r = c.post("/v1/encoders", json={"path": "bad2"})
    assert r.status_code == 202
    assert wait_verdict(srv, c, "bad@2")["guard_status"] == "refused"
    r = c.put("/v1/aliases/games", json={"encoder": "bad@2"})
    assert r.status_code == 409 and r.json()["error"] == "guard_refused"
    assert c.put("/v1/aliases/games", json={"encoder": "bad@2", "force": True}).status_code == 200
    assert c.get("/v1/encoders/bad@2").json()["forced"] is True
    assert _served_by(c, domain="games") == "bad@2"
    assert c.delete("/v1/aliases/games").status_code == 200
    assert c.delete("/v1/encoders/bad@2").status_code == 200


def test_a_verdict_never_lands_on_other_files_of_the_same_key(server):
    """stale@1 (harmless files) is judged; before its verdict is stored it is deleted and
    stale@1 is registered again with over-tuned files: the old 'passed' is dropped, the new
    files stay 'evaluating' until their own evaluation refuses them."""
    srv, c = server
    reg = srv.app.state.qs.registry
    store = reg.scheduler.store_verdict
    arrived = [threading.Event(), threading.Event()]
    go = [threading.Event(), threading.Event()]
    stored: list[bool] = []
    first_done = threading.Event()

    def held_store(key: str, *args: Any) -> bool:
        i = len(stored)
        arrived[i].set()
        assert go[i].wait(120)
        ok = store(key, *args)
        stored.append(ok)
        first_done.set()
        return ok

    reg.scheduler.store_verdict = held_store
    try:
        assert c.post("/v1/encoders", json={"path": "staleA"}).status_code == 202
        assert arrived[0].wait(120)          # staleA judged (it passed); its verdict not yet stored
        assert c.delete("/v1/encoders/stale@1").status_code == 200
        r = c.post("/v1/encoders", json={"path": "staleB"})
        assert r.status_code == 202 and r.json()["created"] is True
        go[0].set()
        assert first_done.wait(120) and stored == [False]    # dropped: it judged other files
        assert c.get("/v1/encoders/stale@1").json()["guard_status"] == "evaluating"
        r = c.post("/v1/search", json={"query": "chess", "encoder": "stale@1"})
        assert r.status_code == 409 and r.json()["error"] == "guard_pending"
        assert arrived[1].wait(120)
        go[1].set()
        info = wait_verdict(srv, c, "stale@1")
    finally:
        for e in go:
            e.set()
        del reg.scheduler.store_verdict
    assert stored == [False, True]
    assert info["guard_status"] == "refused" and info["evaluation"]["passed"] is False
    assert info["evaluation"]["encoder_digest"] == reg.record("stale@1").digest
    assert c.delete("/v1/encoders/stale@1").status_code == 200


@pytest.mark.parametrize("folder", ["BASE", "Default"])
def test_reserved_names_are_refused_in_any_case(server, folder):
    srv, c = server
    r = c.post("/v1/encoders", json={"path": folder})
    assert r.status_code == 409 and "reserved" in r.json()["detail"], r.text
    r = c.post("/v1/search", json={"query": "chess", "encoder": folder})
    assert r.status_code == 404, r.text


def test_a_case_variant_of_the_default_alias_is_refused(server):
    srv, c = server
    r = c.put("/v1/aliases/Default", json={"encoder": "ident@1"})
    assert r.status_code == 400 and "reserved" in r.json()["detail"], r.text


def test_sentinels_that_lost_judged_documents_give_insufficient_evidence(data, tiny_model_dir, tmp_path, caplog):
    """Deleting 70 of sentinel alpha's 80 judged documents leaves 10 queries (< 20): no encoder
    'passes' on them; a restart becomes ready with a warning and lists no document id."""
    shutil.copytree(data["index"], tmp_path / "idx")
    s = server_settings(tmp_path, tiny_model_dir, tmp_path / "idx", encoders_root=data["root"],
                        admin_token=ADMIN, sentinels=data["sentinels"])
    gone = data["alpha_docs"][:70]
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        assert c.request("DELETE", "/v1/documents", json={"ids": gone}).json()["deleted"] == 70
        r = c.post("/v1/encoders", json={"path": "mild1"})
        info = wait_verdict(srv, c, r.json()["encoder"]["key"])
        assert info["guard_status"] == "insufficient_evidence" and info["evaluation"]["passed"] is False
        rows = {x["name"]: x for x in info["evaluation"]["checks"]}
        assert rows["alpha"]["n"] == 10 and rows["alpha"]["min_queries"] == 20
        assert rows["alpha"]["verdict"] == "insufficient_evidence" and rows["beta"]["n"] == 80
        r = c.post("/v1/search", json={"query": "chess", "encoder": "mild@1"})
        assert r.status_code == 409 and "sentinel alpha has 10 judged queries left, needs 20" in r.json()["detail"]
        r = c.post("/v1/encoders", json={"path": "mild1", "force": True})   # accepted unjudged, on record
        assert r.status_code == 200 and r.json()["encoder"]["forced"] is True
        assert _served_by(c, encoder="mild@1") == "mild@1"
    with caplog.at_level("WARNING", logger="qswap.server"), LiveServer(s) as srv, srv.client(ADMIN) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200 and not any(d in ready.text for d in gone)
        warned = [r for r in caplog.records if r.getMessage().startswith("sentinel judgements dropped")]
        assert [(w.sentinel, w.judgements_dropped, w.queries_left) for w in warned] == [("alpha", 70, 10)]
