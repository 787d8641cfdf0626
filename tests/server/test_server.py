"""The real server over HTTP: uvicorn on 127.0.0.1, a real 50-document index, real encoders."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import threading
from pathlib import Path

import httpx
import pytest

from qswap.answers import SearchResponse

from ..encoders.adapters import make_overrides
from ..handshake import Counter, held_first_call
from .conftest import ADMIN
from .exact import TOL, assert_served_by as _assert_served_by, exact_scores as _exact_scores


def _tar_gz(src: Path, arcname: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(src, arcname=arcname)
    return buf.getvalue()


@pytest.fixture(scope="module")
def admin(live):
    with live.client(ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def anon(live):
    with live.client() as c:
        yield c


@pytest.fixture(scope="module")
def registered(admin):
    """ft@1, ft@2 (LoRA), bias@1, part@1 registered by path."""
    for d in ("ft1", "ft2", "bias1", "part1"):
        r = admin.post("/v1/encoders", json={"path": d})
        assert r.status_code in (200, 201), r.text
    return ["ft@1", "ft@2", "bias@1", "part@1"]


@pytest.fixture(scope="module")
def ids(corpus_docs):
    return [d["id"] for d in corpus_docs]


# ----------------------------------------------------------------------------- basics


def test_health_ready_request_id(anon):
    assert anon.get("/healthz").json() == {"status": "ok"}
    r = anon.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True and r.json()["index_documents"] == 50
    r = anon.post("/v1/search", json={"query": "chess"}, headers={"X-Request-ID": "client-id.42"})
    assert r.headers["x-request-id"] == "client-id.42"
    r = anon.post("/v1/search", json={"query": "chess"}, headers={"X-Request-ID": "bad id with spaces" * 20})
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and " " not in rid


def test_readyz_says_what_the_backend_still_builds(anon, live, registered):
    backend = live.app.state.qs.backend
    # Whatever was started in the background (the shared graph, part@1's merged export, the
    # mixed-batch graphs if a batch mixed encoders): awaited, so nothing is in flight now.
    for key in ("base", *registered):
        assert backend.wait(key, timeout=120)
        backend.merged.wait(key, timeout=120)
    backend.segments_ready(wait=120)
    backend.groups_side_by_side(wait=120)
    assert backend.building() == []
    assert anon.get("/readyz").json()["warming"] == []


def test_search_results_are_exact_for_every_encoder(anon, registered, reference_pool, doc_embeddings, ids):
    q = "chess puzzle game"
    r = anon.post("/v1/search", json={"query": q, "k": 5})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    # The route answers with hand-built JSON: it must be exactly the documented model.
    assert SearchResponse.model_validate_json(r.content).model_dump() == r.json()
    res = r.json()["results"][0]
    assert res["encoder"]["key"] == "base" and res["truncated"] is False
    assert set(res["timings"]) == {"queue_ms", "encode_ms", "search_ms"}
    _assert_served_by(res["hits"], reference_pool, doc_embeddings, ids, "base", q, 5)
    for key in registered:
        r = anon.post("/v1/search", json={"queries": [q, "audio video"], "k": 4, "encoder": key})
        assert r.status_code == 200, r.text
        out = r.json()["results"]
        assert [o["encoder"] for o in out] == [{"key": key, "name": key.split("@")[0],
                                                "version": key.split("@")[1], "forced": False}] * 2
        _assert_served_by(out[0]["hits"], reference_pool, doc_embeddings, ids, key, q, 4)
        _assert_served_by(out[1]["hits"], reference_pool, doc_embeddings, ids, key, "audio video", 4)
    r = anon.post("/v1/search", json={"query": q, "encoder": "ft"})   # name -> latest version
    assert r.json()["results"][0]["encoder"]["key"] == "ft@2"


def test_filter_and_with_text(anon, corpus_docs):
    r = anon.post("/v1/search", json={"query": "music", "k": 20, "filter": {"section": "games"},
                                      "with_text": False})
    hits = r.json()["results"][0]["hits"]
    games = {d["id"] for d in corpus_docs if d["section"] == "games"}
    assert {h["id"] for h in hits} == games            # 13 of 50 documents match
    assert all(h["text"] is None and h["metadata"]["section"] == "games" for h in hits)
    texts = {d["id"]: d["text"] for d in corpus_docs}
    hits = anon.post("/v1/search", json={"query": "music", "k": 3}).json()["results"][0]["hits"]
    assert all(h["text"] == texts[h["id"]] for h in hits)


# ----------------------------------------------------------------------------- registration


def test_listing_and_idempotent_registration(anon, admin, registered):
    # The default backend is the shared ONNX session; torch serves until its export is ready.
    assert {e["runtime"] for e in anon.get("/v1/encoders").json()["encoders"]} <= {"torch", "onnx-shared", "onnx"}
    listing = anon.get("/v1/encoders").json()
    assert listing["default"] == "base"
    assert [e["key"] for e in listing["encoders"]][:1] == ["base"]
    assert set(registered) <= {e["key"] for e in listing["encoders"]}
    info = anon.get("/v1/encoders/ft").json()
    assert info["key"] == "ft@2" and info["kind"] == "lora" and info["loaded"] is True
    r = admin.post("/v1/encoders", json={"path": "ft1"})
    assert r.status_code == 200 and r.json()["created"] is False
    assert anon.get("/v1/encoders/nope@1").status_code == 404


def test_register_path_refusals(admin, encoders_root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    outside_enc = outside / "enc"
    shutil.copytree(encoders_root / "bias1", outside_enc)
    link = encoders_root / "escape-link"
    if not link.exists():
        link.symlink_to(outside_enc, target_is_directory=True)
    tampered = encoders_root / "tampered"
    if not tampered.exists():
        shutil.copytree(encoders_root / "part1", tampered)
        (tampered / "adapter.safetensors").write_bytes(b"\x00" * 64)
    filelink = encoders_root / "filelink"
    if not filelink.exists():
        shutil.copytree(encoders_root / "bias1", filelink)
        (filelink / "adapter.safetensors").unlink()
        (filelink / "adapter.safetensors").symlink_to(outside_enc / "adapter.safetensors")
    cases = {
        # '..' is refused by the schema (422); what cannot name an encoder directory under
        # the root is "not found", a name component no file system takes included.
        "../outside": (422, "validation_error"), "ft1/../../x": (422, "validation_error"),
        str(outside_enc): (404, "not_found"), "escape-link": (404, "not_found"),
        "missing-dir": (404, "not_found"), "tampered": (422, "integrity_error"),
        "filelink": (400, "invalid_input"), "x" * 256: (404, "not_found"),
        "\u00e9" * 128: (404, "not_found"), ".": (404, "not_found"),
    }
    for path, (status, code) in cases.items():
        r = admin.post("/v1/encoders", json={"path": path})
        assert (r.status_code, r.json().get("error")) == (status, code), (path, r.text)
        assert r.json()["detail"] and r.json()["hint"]
    assert admin.get("/v1/encoders/tampered").status_code == 404


def test_wrong_space_refused_while_serving(live, admin):
    results: list[int] = []
    answered = Counter()
    stop = threading.Event()

    def traffic() -> None:
        with live.client() as c:
            while not stop.is_set():
                results.append(c.post("/v1/search", json={"query": "linux server", "k": 3}).status_code)
                answered.add()

    t = threading.Thread(target=traffic)
    t.start()
    try:
        assert answered.wait_for(3)                       # searches are being served ...
        r = admin.post("/v1/encoders", json={"path": "alien"})
        assert answered.wait_for(answered.value + 3)      # ... and still are after the refusal
    finally:
        stop.set()
        t.join()
    assert r.status_code == 409
    body = r.json()
    assert body["error"] == "space_mismatch" and body["field"] == "weights_sha256"
    assert "weights_sha256" in body["detail"]
    assert results and set(results) == {200}


def test_upload_archive(admin, anon, tiny_base, tmp_path):
    enc = make_overrides(tiny_base, tmp_path / "up", "uploaded", "bias", seed=21)
    data = _tar_gz(enc, "uploaded")
    r = admin.post("/v1/encoders", files={"archive": ("up.tar.gz", data, "application/gzip")},
                   data={"force": "false"})
    assert r.status_code == 201, r.text
    assert r.json()["encoder"]["key"] == "uploaded@1" and r.json()["encoder"]["source"] == "upload:up.tar.gz"
    r = admin.post("/v1/encoders", files={"archive": ("up.tar.gz", data, "application/gzip")})
    assert r.status_code == 200 and r.json()["created"] is False
    assert anon.post("/v1/search", json={"query": "x", "encoder": "uploaded@1"}).status_code == 200
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as t:
        info = tarfile.TarInfo("../../evil")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    r = admin.post("/v1/encoders", files={"archive": ("e.tar.gz", evil.getvalue(), "application/gzip")})
    assert r.status_code == 400 and r.json()["error"] == "invalid_input"
    r = admin.post("/v1/encoders", files={"archive": ("e.tar.gz", b"plain text", "application/gzip")})
    assert r.status_code == 400
    r = admin.post("/v1/encoders", files={"other": ("e.tar.gz", data, "application/gzip")})
    assert r.status_code == 422 and r.json()["error"] == "validation_error"
    r = admin.post("/v1/encoders", files={"archive": ("up.tar.gz", data, "application/gzip")},
                   data={"force": "maybe"})
    assert r.status_code == 422
    r = admin.post("/v1/encoders", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type"


def test_guard_refuses_unless_forced(admin, tiny_base, encoders_root):
    from qswap.encoders import load_encoder, save_encoder
    art = load_encoder(encoders_root / "bias1")
    d = encoders_root / "guarded"
    if not d.exists():
        save_encoder(d, name="guarded", version="1", kind="bias", space=tiny_base.space, tensors=art.overrides,
                     guard={"passed": False, "z_critical": 1.96, "checks": [
                         {"name": "sentinel", "metric": "mrr@10", "degraded": True, "z": -3.1}]})
    r = admin.post("/v1/encoders", json={"path": "guarded"})
    assert r.status_code == 409 and r.json()["error"] == "guard_refused", r.text
    r = admin.post("/v1/encoders", json={"path": "guarded", "force": True})
    assert r.status_code == 201, r.text


# ----------------------------------------------------------------------------- hot swap


def test_alias_switch_under_concurrent_load(live, admin, anon, registered, reference_pool, doc_embeddings, ids):
    q1, q2 = "chess puzzle game", "network server data"
    s1 = _exact_scores(reference_pool, doc_embeddings, ids, "ft@1", q1)
    s2 = _exact_scores(reference_pool, doc_embeddings, ids, "ft@2", q1)
    assert max(abs(s1[i] - s2[i]) for i in ids) > 10 * TOL    # the two versions are distinguishable
    assert admin.put("/v1/aliases/games", json={"encoder": "ft@1"}).status_code == 200
    before = anon.get("/metrics").text
    # The first forward pass waits until three requests are admitted (in the held batch or queued
    # behind it), so that batches merge requests however fast this machine encodes. Counted as
    # admitted, not as queued: when the clients' requests all arrive before the first batch forms,
    # they are in it, and nothing more can queue behind it (each client has one request in flight).
    forward = live.app.state.qs.batcher.forward
    real_encode = forward.encode_fn
    forward.encode_fn = held_first_call(real_encode, lambda: live.app.state.qs.batcher.pending >= 3)
    responses: list[tuple[int, dict]] = []
    answered = Counter()
    errors: list[str] = []
    stop = threading.Event()

    def client_loop() -> None:
        with live.client() as c:
            while not stop.is_set():
                try:
                    r = c.post("/v1/search", json={"queries": [q1, q2], "k": 5, "domain": "games"})
                    responses.append((r.status_code, r.json()))
                except httpx.HTTPError as e:
                    errors.append(repr(e))
                answered.add()

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for t in threads:
        t.start()
    switches = []
    try:
        for i in range(10):
            assert answered.wait_for(answered.value + 2)   # requests ran since the last switch
            r = admin.put("/v1/aliases/games", json={"encoder": "ft@2" if i % 2 == 0 else "ft@1"})
            assert r.status_code == 200
            switches.append(r.json())
    finally:
        stop.set()
        for t in threads:
            t.join()
        forward.encode_fn = real_encode
    assert not errors
    assert len(responses) >= 20
    assert {status for status, _ in responses} == {200}
    seen = set()
    for _, body in responses:
        keys = {res["encoder"]["key"] for res in body["results"]}
        assert len(keys) == 1                         # one request, one encoder version
        key = keys.pop()
        assert key in ("ft@1", "ft@2")
        seen.add(key)
        _assert_served_by(body["results"][0]["hits"], reference_pool, doc_embeddings, ids, key, q1, 5)
    assert seen == {"ft@1", "ft@2"}
    assert switches[0]["previous"] == "ft@1" and switches[0]["encoder"] == "ft@2"
    assert anon.get("/v1/aliases").json()["aliases"]["games"] == "ft@1"

    def merged(text: str) -> tuple[float, float]:
        vals = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
                if ln.startswith("qswap_batch_requests_")}
        return vals["qswap_batch_requests_sum"], vals["qswap_batch_requests_count"]
    (s0, c0), (s1_, c1) = merged(before), merged(anon.get("/metrics").text)
    assert (s1_ - s0) > (c1 - c0)                     # some batches merged several requests


def test_delete_encoder(admin, anon, encoders_root, tiny_base):
    d = encoders_root / "todelete"
    if not d.exists():
        make_overrides(tiny_base, d, "todelete", "bias", seed=31)
    assert admin.post("/v1/encoders", json={"path": "todelete"}).status_code == 201
    assert admin.put("/v1/aliases/tmpdom", json={"encoder": "todelete"}).json()["encoder"] == "todelete@1"
    r = admin.delete("/v1/encoders/todelete@1")
    assert r.status_code == 409 and r.json()["error"] == "conflict"
    assert admin.delete("/v1/aliases/tmpdom").status_code == 200
    assert admin.delete("/v1/aliases/tmpdom").status_code == 404
    r = admin.delete("/v1/encoders/todelete")   # exact version needed: the path pattern says so
    assert r.status_code == 422 and r.json()["hint"]
    r = admin.delete("/v1/encoders/todelete@1")
    assert r.status_code == 200 and r.json() == {"deleted": "todelete@1"}
    assert anon.get("/v1/encoders/todelete@1").status_code == 404
    r = anon.post("/v1/search", json={"query": "x", "encoder": "todelete@1"})
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert anon.post("/v1/search", json={"query": "x"}).status_code == 200


# ----------------------------------------------------------------------------- security and limits


def test_register_content_types(admin):
    r = admin.post("/v1/encoders", content=b"path=ft1", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type" and r.json()["hint"]
    r = admin.post("/v1/encoders", content=b"--x\r\nbroken", headers={"content-type": "multipart/form-data; boundary=x"})
    assert 400 <= r.status_code < 500 and r.json()["hint"], r.text


def test_admin_routes_need_the_token(live, anon):
    for method, path, kw in [("POST", "/v1/encoders", {"json": {"path": "ft1"}}),
                             ("PUT", "/v1/aliases/x", {"json": {"encoder": "base"}}),
                             ("DELETE", "/v1/encoders/ft@1", {}),
                             ("POST", "/v1/documents", {"json": {"documents": [{"id": "a", "text": "b"}]}})]:
        r = anon.request(method, path, **kw)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        with live.client("wrong-token-0123456789abcdef") as c:
            assert c.request(method, path, **kw).status_code == 401
    assert anon.get("/v1/aliases").status_code == 200           # reading is search-level (open here)


def test_limits_and_bad_input_are_4xx(anon):
    cases = [
        ({"query": "x", "k": 21}, 422, "limit_exceeded"),
        ({"queries": ["x"] * 9}, 422, "limit_exceeded"),
        ({"query": ""}, 422, "validation_error"),
        ({"query": "   "}, 422, "validation_error"),
        ({"queries": []}, 422, "validation_error"),
        ({}, 422, "validation_error"),
        ({"query": "x", "queries": ["y"]}, 422, "validation_error"),
        ({"query": "x", "k": 0}, 422, "validation_error"),
        ({"query": "x", "k": "many"}, 422, "validation_error"),
        ({"query": "x", "extra": 1}, 422, "validation_error"),
        ({"query": "x", "encoder": "ft@1", "domain": "games"}, 422, "validation_error"),
        ({"query": "x", "encoder": "nope"}, 404, "not_found"),
        ({"query": "x", "encoder": "nope@3"}, 404, "not_found"),
        ({"query": "x", "domain": "unknown-domain"}, 404, "not_found"),
        ({"query": "x", "filter": {"section": ["a", "b"]}}, 422, "validation_error"),
        ({"query": 5}, 422, "validation_error"),
        # strict types: nothing is coerced
        ({"query": "x", "k": "5"}, 422, "validation_error"),
        ({"query": "x", "k": True}, 422, "validation_error"),
        ({"query": "x", "k": 5.5}, 422, "validation_error"),
        ({"query": "x", "with_text": "yes"}, 422, "validation_error"),
        ({"query": None, "queries": ["x"]}, 422, "validation_error"),
        # what the index cannot store or compare
        ({"query": "x", "filter": {"n": 2 ** 63}}, 422, "validation_error"),
        ({"query": "x", "filter": {"n": -(2 ** 63) - 1}}, 422, "validation_error"),
        ({"query": "x", "filter": {f"f{i}": 1 for i in range(1000)}}, 422, "validation_error"),
        ({"query": "x", "filter": {'a"b': 1}}, 422, "validation_error"),
        ({"query": "x", "domain": "a/b"}, 422, "validation_error"),
        ({"query": "x", "encoder": "ft@1@2"}, 422, "validation_error"),
    ]
    for body, status, code in cases:
        r = anon.post("/v1/search", json=body)
        assert (r.status_code, r.json().get("error")) == (status, code), (body, r.text)
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]
    r = anon.post("/v1/search", json={"query": "x", "filter": {"n": 2 ** 63 - 1, "s": "a", "b": True}})
    assert r.status_code == 200   # the int64 edge itself is fine
    # Lone surrogates (valid JSON escapes, not valid Unicode) in every text field.
    for raw in (b'{"query": "\\udc00"}', b'{"query": "x", "filter": {"\\udc00": 1}}',
                b'{"query": "x", "filter": {"s": "\\ud800"}}'):
        r = anon.post("/v1/search", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["hint"], (raw, r.text)
    r = anon.post("/v1/search", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "validation_error"
    r = anon.post("/v1/search", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 422
    big = {"query": "x" * (70 * 1024)}
    r = anon.post("/v1/search", json=big)
    assert r.status_code == 413 and r.json()["error"] == "payload_too_large"

    def chunks():
        for _ in range(100):
            yield b" " * 1024
    r = anon.post("/v1/search", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "payload_too_large"   # no content-length
    deep = b'{"query": "x", "filter": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"   # json.loads gives up
    r = anon.post("/v1/search", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_input" and r.json()["hint"], r.text
    r = anon.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"] == "not_found" and r.json()["hint"]
    r = anon.get("/v1/search")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed" and r.json()["hint"]


def test_long_queries_are_truncated_and_flagged(anon):
    long_words = " ".join(["chess"] * 200)          # > 64 tokens of the tiny model
    r = anon.post("/v1/search", json={"queries": ["chess", long_words, "y" * 1000], "k": 2})
    assert r.status_code == 200
    assert [res["truncated"] for res in r.json()["results"]] == [False, True, True]
    r2 = anon.post("/v1/search", json={"query": " ".join(["chess"] * 120), "k": 2})
    # Both cut at max tokens: the same hits (scores equal to float rounding: one batch of 3 rows
    # and one of 1 run the fused attention kernel with other shapes).
    alone, batched = r2.json()["results"][0]["hits"], r.json()["results"][1]["hits"]
    assert [h["id"] for h in alone] == [h["id"] for h in batched]
    assert [h["score"] for h in alone] == pytest.approx([h["score"] for h in batched], abs=1e-5)


def test_metrics_after_traffic(anon):
    anon.post("/v1/search", json={"query": "metrics please"})
    anon.post("/v1/search", json={"query": "x", "k": 1000})
    text = anon.get("/metrics").text
    for needle in ('qswap_request_duration_seconds_bucket{encoder="base",le="0.005",route="/v1/search"}',
                   'qswap_requests_total{method="POST",route="/v1/search",status="200"}',
                   "qswap_queue_seconds_count", "qswap_encode_seconds_count", "qswap_search_seconds_count",
                   "qswap_batch_size_bucket", 'qswap_errors_total{code="limit_exceeded",status="422"}',
                   'qswap_encoder_registrations_total{result="created"}', "qswap_encoders_loaded ",
                   'qswap_queries_total{encoder="base"}', "qswap_index_documents 5", "qswap_ready 1.0",
                   "# TYPE qswap_runtime_builds_total counter", 'qswap_runtime_builds_total{kind="shared graph"} 1.0'):
        assert needle in text, needle
    assert "_created" not in text


def test_documents_upsert_and_delete(admin, anon):
    before = anon.get("/readyz").json()["index_documents"]
    docs = [{"id": "new-1", "text": "chess puzzle physics", "metadata": {"section": "fresh"}},
            {"id": "new-2", "text": "audio video music", "metadata": {"section": "fresh", "n": 2}}]
    try:
        r = admin.post("/v1/documents", json={"documents": docs})
        assert r.status_code == 200 and r.json() == {"upserted": 2, "count": before + 2}
        hits = anon.post("/v1/search", json={"query": "chess", "k": 10, "filter": {"section": "fresh"}}
                         ).json()["results"][0]["hits"]
        assert sorted(h["id"] for h in hits) == ["new-1", "new-2"]
        r = admin.post("/v1/documents", json={"documents": [{"id": "x", "text": ""}]})
        assert r.status_code == 422
    finally:
        r = admin.request("DELETE", "/v1/documents", json={"ids": ["new-1", "new-2", "never-there"]})
    assert r.status_code == 200 and r.json() == {"deleted": 2, "count": before}
    hits = anon.post("/v1/search", json={"query": "chess", "filter": {"section": "fresh"}}).json()
    assert hits["results"][0]["hits"] == []


def test_openapi_committed_copy_matches(anon):
    from qswap.server.http.app import OPENAPI_FILE, openapi_schema
    committed = json.loads(OPENAPI_FILE.read_text())
    assert committed == openapi_schema(), "run `qswap serve --write-openapi server/openapi.json`"
    served = anon.get("/openapi.json").json()
    # The running server writes its configured limits (this one: max_k 20, max_queries 8).
    req = served["components"]["schemas"]["SearchRequest"]["properties"]
    assert (req["k"]["maximum"], req["queries"]["maxItems"]) == (20, 8)
    committed_req = committed["components"]["schemas"]["SearchRequest"]["properties"]
    assert (committed_req["k"]["maximum"], committed_req["queries"]["maxItems"]) == (100, 64)
    emb = served["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert emb["dimensions"]["maximum"] == 32   # the loaded model's dimension
    for schema in (served, committed):
        for model in ("SearchRequest", "EmbeddingRequest", "TeiEmbedRequest"):
            schema["components"]["schemas"][model]["properties"] = {}
    assert served == committed


# ----------------------------------------------------------------------------- other configurations
