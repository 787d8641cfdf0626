"""The server's own guard: a real uvicorn server, a real index, sentinels over it, real encoders."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
import torch

from qswap.encoders import save_encoder

from .conftest import ADMIN, WORDS, LiveServer, server_settings

N_DOCS = 160


def _wait_verdict(c: httpx.Client, key: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = c.get(f"/v1/encoders/{key}").json()
        if info["guard_status"] != "evaluating":
            return info
        assert time.monotonic() < deadline, f"{key} still evaluating"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def guard_data(tmp_path_factory, tiny_base):
    """A 160-document index, two sentinels over it (80 judged queries each), encoder directories."""
    from qswap.index import build_index
    from qswap.beir import write_jsonl, write_qrels

    tmp = tmp_path_factory.mktemp("guarded")
    rng = random.Random(7)
    docs = [{"id": f"g{i:03d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 10)))}
            for i in range(N_DOCS)]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    build_index(tmp / "corpus.jsonl", tmp / "idx", tiny_base.encode_documents, tiny_base.space,
                progress=False).close()
    sent = tmp / "sentinels"
    for s, part in (("alpha", docs[:80]), ("beta", docs[80:])):
        (sent / s / "qrels").mkdir(parents=True)
        # A query is its document's text minus its last word: the base finds most of them.
        write_jsonl(sent / s / "queries.jsonl",
                    [{"_id": f"q{d['id']}", "text": d["text"].rsplit(" ", 1)[0]} for d in part])
        write_qrels(sent / s / "qrels" / "test.tsv", [(f"q{d['id']}", d["id"], 1) for d in part])
    root = tmp / "encroot"
    root.mkdir()
    g = torch.Generator().manual_seed(3)
    biases = {n: p.detach() for n, p in tiny_base.model.named_parameters() if n.endswith(".bias")}
    # Over-tuned: every bias pushed far off (what a too-high learning rate does), yet its
    # manifest claims the tuning guard passed.
    bad = {n: t + 3.0 * torch.randn(t.shape, generator=g) for n, t in biases.items()}
    claims = {"passed": True, "checks": []}
    for v in ("1", "2"):
        save_encoder(root / f"bad{v}", name="bad", version=v, kind="bias", space=tiny_base.space, tensors=bad,
                     guard=claims)
    # A tiny, harmless change and the identity, both without any guard record.
    mild = {n: t + 1e-4 * torch.randn(t.shape, generator=g) for n, t in biases.items()}
    save_encoder(root / "mild1", name="mild", version="1", kind="bias", space=tiny_base.space, tensors=mild)
    save_encoder(root / "ident1", name="ident", version="1", kind="identity", space=tiny_base.space)
    return {"tmp": tmp, "index": tmp / "idx", "sentinels": sent, "root": root}


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
    info = _wait_verdict(c, "bad@1")
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
    r = c.post("/v1/encoders", json={"path": "mild1"})
    assert r.status_code == 202
    r = c.put("/v1/aliases/web", json={"encoder": "mild@1"})
    assert r.status_code in (200, 409)      # 409 guard_pending unless the (tiny) evaluation already ended
    if r.status_code == 409:
        assert r.json()["error"] == "guard_pending"
    info = _wait_verdict(c, "mild@1")
    assert info["guard_status"] == "passed", info["evaluation"]
    assert info["evaluation"]["against"] == ["base", "ident@1"]
    assert {(x["name"], x["against"]) for x in info["evaluation"]["checks"]} == {
        ("alpha", "base"), ("beta", "base"), ("alpha", "ident@1"), ("beta", "ident@1")}
    assert c.put("/v1/aliases/web", json={"encoder": "mild@1"}).status_code == 200
    assert c.post("/v1/search", json={"query": "chess", "domain": "web"}).json()["results"][0]["encoder"]["key"] \
        == "mild@1"


def test_sentinels_with_unknown_documents_fail_the_start(tmp_path, tiny_model_dir, index_dir):
    from qswap.beir import write_jsonl, write_qrels
    (tmp_path / "s" / "x" / "qrels").mkdir(parents=True)
    write_jsonl(tmp_path / "s" / "x" / "queries.jsonl", [{"_id": "q1", "text": "chess"}])
    write_qrels(tmp_path / "s" / "x" / "qrels" / "test.tsv", [("q1", "no-such-doc", 1)])
    s = server_settings(tmp_path, tiny_model_dir, index_dir, sentinels=tmp_path / "s")
    srv = LiveServer(s)
    with pytest.raises(RuntimeError, match="not in the served index"):
        srv.start()
    srv.stop()


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
        info = _wait_verdict(c, "bad@1")
        assert info["guard_status"] == "refused" and info["evaluation"]["passed"] is False
        # The existing alias keeps serving (a restart must not take a domain down) ...
        r = c.post("/v1/search", json={"query": "chess", "domain": "games"})
        assert r.status_code == 200 and r.json()["results"][0]["encoder"]["key"] == "bad@1"
        # ... but no new alias, and no search by name.
        assert c.put("/v1/aliases/music", json={"encoder": "bad@1"}).status_code == 409
        assert c.post("/v1/search", json={"query": "chess", "encoder": "bad@1"}).status_code == 409
