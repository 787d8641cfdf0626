"""Servers with other settings than test_server's module server: auth modes, read-only, restarts,
readiness, the CLI's refusals, the demo index, the ONNX backend and bf16 queries."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from qswap.errors import NotReadyError, error_from_body

from ..encoders.adapters import make_lora
from .conftest import ADMIN, SEARCH, LiveServer, server_settings
from .exact import assert_served_by as _assert_served_by, exact_scores as _exact_scores


@pytest.fixture(scope="module")
def ids(corpus_docs):
    return [d["id"] for d in corpus_docs]


def test_auth_modes_and_read_only(tmp_path, tiny_model_dir, index_dir):
    s = server_settings(tmp_path / "a", tiny_model_dir, index_dir, search_token=SEARCH, read_only_index=True)
    with LiveServer(s) as srv:
        with srv.client() as c:
            assert c.post("/v1/search", json={"query": "x"}).status_code == 401
            assert c.get("/v1/encoders").status_code == 401
            emb = {"input": "x", "model": "base"}
            for method, path, body in (("POST", "/v1/embeddings", emb), ("POST", "/embeddings", emb),
                                       ("GET", "/v1/models", None), ("POST", "/tei/base/embed", {"inputs": "x"})):
                assert c.request(method, path, json=body).status_code == 401, path
            # /metrics lists encoder keys and sentinel scores: behind the search token too
            assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 401
        with srv.client(SEARCH) as c:
            assert c.post("/v1/search", json={"query": "x"}).status_code == 200
            assert c.post("/v1/embeddings", json={"input": "x", "model": "base"}).status_code == 200
            r = c.put("/v1/aliases/x", json={"encoder": "base"})
            assert r.status_code == 403 and r.json()["error"] == "forbidden"   # no admin token: admin off
    s = server_settings(tmp_path / "b", tiny_model_dir, index_dir, insecure=True, read_only_index=True)
    with LiveServer(s) as srv, srv.client() as c:
        r = c.put("/v1/aliases/x", json={"encoder": "base"})
        assert r.status_code == 200 and r.json()["encoder"] == "base"
        r = c.post("/v1/documents", json={"documents": [{"id": "a", "text": "b"}]})
        assert r.status_code == 400 and "read-only" in r.json()["detail"]
    from qswap.errors import InvalidInputError
    from qswap.server.http.app import create_app
    with pytest.raises(InvalidInputError):
        create_app(server_settings(tmp_path / "c", tiny_model_dir, index_dir, insecure=True, host="0.0.0.0"))


def test_restart_keeps_encoders_and_aliases(tmp_path, tiny_model_dir, index_dir, tiny_base, reference_pool,
                                            doc_embeddings, ids):
    root = tmp_path / "root"
    make_lora(tiny_base, root / "r1", "rl", seed=11, version="1")    # same weights as ft@1
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=root, admin_token=ADMIN,
                        read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        assert c.post("/v1/encoders", json={"path": "r1"}).status_code == 201
        assert c.put("/v1/aliases/games", json={"encoder": "rl@1"}).status_code == 200
    # later edits of the source change nothing: the server serves its own verified copy
    (root / "r1" / "adapter_model.safetensors").write_bytes(b"edited")
    with LiveServer(s.model_copy(update={"default_encoder": "rl"})) as srv, srv.client() as c:
        assert c.get("/v1/aliases").json()["aliases"] == {"games": "rl@1"}
        assert c.get("/readyz").json()["default_encoder"] == "rl@1"
        for body in ({"query": "chess puzzle game", "domain": "games", "k": 5},
                     {"query": "chess puzzle game", "k": 5}):
            res = c.post("/v1/search", json=body).json()["results"][0]
            assert res["encoder"]["key"] == "rl@1"
            _assert_served_by(res["hits"], reference_pool, doc_embeddings, ids, "ft@1", "chess puzzle game", 5)
    assert json.loads((tmp_path / "state" / "registry.json").read_text())["aliases"] == {"games": "rl@1"}


def test_not_ready_answers_503(tmp_path, tiny_model_dir):
    bogus = tmp_path / "not-an-index"
    bogus.mkdir()
    (bogus / "junk.txt").write_text("x")
    srv = LiveServer(server_settings(tmp_path, tiny_model_dir, bogus, admin_token=ADMIN))
    srv.start(wait_ready=False)
    try:
        with srv.client() as c:
            srv.app.state.qs._loader.join(20)            # the loading thread has given up
            assert srv.app.state.qs.load_error is not None
            r = c.get("/readyz")
            assert r.status_code == 503 and r.json()["error"] == "not_ready" and "failed" in r.json()["detail"]
            r = c.post("/v1/search", json={"query": "x"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert c.get("/healthz").status_code == 200
            # Every route that needs the index or an encoder answers 503 through the one dependency...
            for method, path, body in [("GET", "/v1/encoders", None), ("GET", "/v1/encoders/base", None),
                                       ("GET", "/v1/aliases", None), ("GET", "/v1/info", None),
                                       ("GET", "/v1/models", None), ("GET", "/tei/base/info", None),
                                       ("POST", "/v1/embeddings", {"input": "x", "model": "base"}),
                                       ("GET", "/v1/experiments", None)]:
                r = c.request(method, path, json=body)
                assert r.status_code == 503 and type(error_from_body(503, r.json())) is NotReadyError, (path, r.text)
            # ...after authentication: an admin route answers 401 without a token, 503 with one.
            assert c.delete("/v1/aliases/games").status_code == 401
        with srv.client(ADMIN) as c:
            r = c.delete("/v1/aliases/games")
            assert r.status_code == 503 and r.json()["error"] == "not_ready", r.text
    finally:
        srv.stop()


def test_every_route_that_serves_depends_on_readiness():
    """One readiness check (its dependency, or the gate's), and no route that reads the index or an encoder without it."""
    from fastapi.routing import APIRoute

    from qswap.server.http.routes import documents, embeddings, encoders, feedback, health, search, tei
    from qswap.server.http.responses import ready_state
    from qswap.server.serving.gate import admission, search_admission

    def calls(dependant):
        for dep in dependant.dependencies:
            yield dep.call
            yield from calls(dep)

    unguarded = {"/healthz", "/readyz", "/metrics", "/v1/documents/jobs/{job_id}"}
    routes = [r for m in (documents, embeddings, encoders, feedback, health, search, tei)
              for r in m.router.routes if isinstance(r, APIRoute)]
    assert len(routes) > 20
    for route in routes:
        # The gate's dependencies check readiness themselves (one dependency level fewer per request).
        ready = set(calls(route.dependant)) & {ready_state, admission, search_admission}
        assert bool(ready) == (route.path not in unguarded), route.path


def test_cli_serve_refusals_and_openapi(tmp_path, monkeypatch):
    from qswap.errors import InvalidInputError
    from qswap.server import cli
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--insecure", "--host", "0.0.0.0"])
    with pytest.raises(InvalidInputError, match="insecure"):
        args.func(args)
    monkeypatch.setenv("QSWAP_ADMIN_TOKEN", "short")
    args = parser.parse_args(["serve"])
    with pytest.raises(InvalidInputError, match="shorter"):
        args.func(args)
    out = tmp_path / "openapi.json"
    args = parser.parse_args(["serve", "--write-openapi", str(out)])
    assert args.func(args) == 0
    from qswap.server.http.app import OPENAPI_FILE
    assert json.loads(out.read_text()) == json.loads(OPENAPI_FILE.read_text())
    assert os.path.getsize(out) > 10_000


def test_demo_index_built_once_then_cached(tmp_path, tiny_model_dir, monkeypatch):
    import qswap.server.demo as demo
    monkeypatch.setattr(demo, "demo_index_dir", lambda: tmp_path / "demo" / "index")
    s = server_settings(tmp_path, tiny_model_dir, None)      # no --index: the bundled demo corpus
    with LiveServer(s) as srv, srv.client() as c:
        info1 = c.get("/v1/info").json()
        assert info1["index"]["documents"] == 400 and info1["admin"] == "disabled"
        r = c.post("/v1/search", json={"query": "chess game", "k": 3, "filter": {"section": "games"}})
        hits = r.json()["results"][0]["hits"]
        assert len(hits) == 3 and all(h["metadata"]["section"] == "games" and h["metadata"]["title"] for h in hits)
    with LiveServer(s) as srv, srv.client() as c:
        info2 = c.get("/v1/info").json()
    assert info2["index"]["created_at"] == info1["index"]["created_at"]   # reused, not rebuilt


def test_onnx_backend_serves_the_same_results(tmp_path, tiny_model_dir, index_dir, encoders_root, reference_pool,
                                              doc_embeddings, ids):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        read_only_index=True, backend="onnx", onnx_threads=1)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        backend = srv.app.state.qs.backend
        assert type(backend).__name__ == "OnnxBackend"
        for d in ("ft1", "bias1"):
            assert c.post("/v1/encoders", json={"path": d}).status_code == 201
        for key in ("base", "ft@1", "bias@1"):
            assert backend.wait(key, timeout=120), backend.error(key)
            q = "chess puzzle game"
            res = c.post("/v1/search", json={"query": q, "k": 5, "encoder": key}).json()["results"][0]
            assert res["encoder"]["key"] == key
            _assert_served_by(res["hits"], reference_pool, doc_embeddings, ids, key, q, 5)
            info = c.get(f"/v1/encoders/{key}").json()
            assert info["runtime"] == "onnx" and info["runtime_error"] is None
        assert c.delete("/v1/encoders/bias@1").status_code == 200
        assert not backend.ready("bias@1") and backend.ready("ft@1")


def test_bf16_query_precision_runs_large_batches_in_bf16(tmp_path, tiny_model_dir, index_dir, encoders_root,
                                                         reference_pool, doc_embeddings, ids):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        read_only_index=True, query_precision="bf16", backend="torch")
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        backend = srv.app.state.qs.backend
        assert backend.precision == "bf16" and backend.precision_for(16) == "bf16"
        assert c.post("/v1/encoders", json={"path": "ft1"}).status_code == 201
        # Spy on the pool: is autocast on when the batch worker encodes?
        seen: list[tuple[int, bool]] = []
        encode = backend.pool.encode

        def spy(texts, keys, *a, **kw):
            seen.append((len(texts), torch.is_autocast_enabled("cpu")))
            return encode(texts, keys, *a, **kw)
        backend.pool.encode = spy
        qs = [f"chess puzzle game number {i}" for i in range(16)]
        # One request of 16 queries is one batch: bf16, scores still within bf16 rounding of fp32.
        res = c.post("/v1/search", json={"queries": qs, "k": 5, "encoder": "ft@1"}).json()["results"]
        for q, r in zip(qs, res):
            exact = _exact_scores(reference_pool, doc_embeddings, ids, "ft@1", q)
            assert max(abs(h["score"] - exact[h["id"]]) for h in r["hits"]) < 0.02
        # A lone query stays fp32: the exact answer.
        one = c.post("/v1/search", json={"query": qs[0], "k": 5, "encoder": "ft@1"}).json()["results"][0]
        _assert_served_by(one["hits"], reference_pool, doc_embeddings, ids, "ft@1", qs[0], 5)
        assert seen == [(16, True), (1, False)]


def test_no_dependency_of_a_route_hops_to_the_thread_pool():
    """Every dependency of every route is ``async`` (or a class FastAPI awaits): a plain ``def``
    runs on the thread pool, a hop per request that costs the event loop most under load."""
    import inspect

    from fastapi.routing import APIRoute

    from qswap.server.http.routes import documents, embeddings, encoders, feedback, health, search, tei

    def calls(dependant):
        for dep in dependant.dependencies:
            yield dep.call
            yield from calls(dep)

    routes = [r for m in (documents, embeddings, encoders, feedback, health, search, tei)
              for r in m.router.routes if isinstance(r, APIRoute)]
    sync = set()
    for route in routes:
        for call in calls(route.dependant):
            fn = call if inspect.isfunction(call) else getattr(call, "__call__", call)
            if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
                sync.add(getattr(call, "__qualname__", repr(call)))
    assert not sync, f"dependencies on the thread pool: {sorted(sync)}"
