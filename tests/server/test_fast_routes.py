"""The fast routes (qswap.server.http.fast_routes) answer as the FastAPI routes they stand for.

Two real uvicorn servers with the same settings: one as built, one with its fast routes removed
(FastAPI alone). Every request goes to both; status, the headers a client acts on, and the body
(less the request id, and the timings of a search) must be the same.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import pytest

from qswap.server.http.fast_routes import FastRoute

from .conftest import ADMIN, SEARCH, LiveServer, server_settings

JSON = {"content-type": "application/json"}
AUTH = {"Authorization": f"Bearer {SEARCH}", **JSON}

# (path, body bytes, headers): bad bodies, bad headers, bad auth, and requests that pass validation
# and are refused (or answered) further on.
CASES: list[tuple[str, bytes, dict[str, str]]] = []
for path, good in (("/v1/search", b'{"query": "chess game"}'),
                   ("/v1/embeddings", b'{"input": "chess game", "model": "base"}')):
    CASES += [(path, body, AUTH) for body in (
        b"", b"{bad", b"[]", b"null", b"{}", b'"text"', b"\xff\xfe{}", b'{"input": 3, "model": "base"}',
        b'{"query": 5}', b'{"query": "x", "bogus": 1}', b'{"query": "x", "queries": ["y"]}',
        b'{"queries": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', b'{"query": "x", "k": 21}',
        b'{"query": "x", "k": 12.0}', b'{"query": "x", "k": "10"}', b'{"query": "x", "with_text": 1}',
        b'{"query": "x", "score_threshold": NaN}', b'{"query": "x", "filter": {"a": 1e400}}',
        b'{"query": "x", "encoder": "nope"}', b'{"query": "x", "domain": "nope"}', b'{"query": "\\ud800"}',
        b'{"query": "x", "query": "y"}', b'{"query": "x", "offset": 30}',
        b'{"input": "x"}', b'{"model": "base"}', b'{"input": [], "model": "base"}',
        b'{"input": ["a", "b", "c", "d", "e"], "model": "base"}', b'{"input": [[1, 2]], "model": "base"}',
        b'{"input": "\\ud800", "model": "base"}', b'{"input": "x", "model": "nope"}',
        b'{"input": "x", "model": "base", "dimensions": 0}', b'{"input": "x", "model": "base", "extra": 1}',
        b'{"input": "x", "model": "base", "encoding_format": "base64"}', good)]
    CASES += [(path, good, headers) for headers in (
        JSON, {"Authorization": "Bearer wrong", **JSON}, {"Authorization": f"Basic {SEARCH}", **JSON},
        {"Authorization": f"Bearer {ADMIN}", **JSON}, {**AUTH, "content-type": "text/plain"},
        {"Authorization": f"Bearer {SEARCH}"}, {**AUTH, "content-type": "application/json; charset=utf-8"},
        {**AUTH, "x-request-timeout": "abc"}, {**AUTH, "x-request-timeout": "0"},
        {**AUTH, "x-request-timeout": "601"}, {**AUTH, "x-request-timeout": "1e1"},
        {**AUTH, "x-request-timeout": "2.5"}, {**AUTH, "x-request-timeout": "-1"})]
    CASES += [(path, b"{bad", JSON), (path, b'{"query": 5, "input": 3}', {"Authorization": "Bearer wrong", **JSON})]


def _servers(tmp: Any, tiny_model_dir: Any, index_dir: Any, encoders_root: Any) -> tuple[LiveServer, LiveServer]:
    def settings(name: str) -> Any:
        return server_settings(tmp / name, tiny_model_dir, index_dir, encoders_root=encoders_root,
                               admin_token=ADMIN, search_token=SEARCH, max_queries=8, max_k=20,
                               max_embedding_inputs=4, read_only_index=True)
    fast, plain = LiveServer(settings("fast")), LiveServer(settings("plain"))
    plain.app.router.routes[:] = [r for r in plain.app.router.routes if not isinstance(r, FastRoute)]
    return fast, plain


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir, index_dir,
         encoders_root) -> Iterator[tuple[LiveServer, LiveServer]]:
    fast, plain = _servers(tmp_path_factory.mktemp("fast"), tiny_model_dir, index_dir, encoders_root)
    try:
        fast.start()
        plain.start()
        yield fast, plain
    finally:
        for srv in (fast, plain):
            if srv.thread.is_alive():
                srv.stop()


def _answer(srv: LiveServer, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    r = httpx.post(srv.url + path, content=body, headers=headers, timeout=30)
    data = r.json()
    data.pop("request_id", None)
    data.pop("timings", None)
    data.pop("took_ms", None)
    if isinstance(data.get("error"), dict):   # the OpenAI dialect carries it inside
        data["error"].pop("request_id", None)
    data = _rounded(data)   # scores and vectors differ in the last bits from run to run (ONNX Runtime)
    for result in data.get("results", ()):   # so near-ties swap places: the hits' shape, not their order
        result["hits"] = [sorted(h) for h in result["hits"]]
        result.pop("timings", None)
    kept = {k: r.headers[k] for k in ("www-authenticate", "retry-after", "content-type") if k in r.headers}
    return r.status_code, kept, data


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return v


def test_the_hot_routes_are_fast_routes(pair):
    fast, plain = pair
    served = {r.path for r in fast.app.router.routes if isinstance(r, FastRoute)}
    assert served == {"/v1/search", "/v1/embeddings"}
    assert not any(isinstance(r, FastRoute) for r in plain.app.router.routes)


@pytest.mark.parametrize("path,body,headers", CASES, ids=[f"{p}:{b[:40]!r}:{sorted(h.items())}" for p, b, h in CASES])
def test_a_fast_route_answers_as_fastapi(pair, path, body, headers):
    fast, plain = pair
    got, want = _answer(fast, path, body, headers), _answer(plain, path, body, headers)
    assert got[:2] == want[:2]
    for key in sorted(set(got[2]) | set(want[2])):   # field by field: a failure names the field
        assert (key, got[2].get(key)) == (key, want[2].get(key))
    assert got[0] < 500 or got[0] == 503, got   # bad input is a 4xx, never a 500


def test_the_schema_keeps_both_routes(pair):
    fast, plain = pair
    paths, plain_paths = fast.app.openapi()["paths"], plain.app.openapi()["paths"]
    for path in ("/v1/search", "/v1/embeddings"):
        assert paths[path] == plain_paths[path]
        assert "requestBody" in paths[path]["post"]


def test_other_methods_reach_the_fastapi_route(pair):
    fast, plain = pair
    for path in ("/v1/search", "/v1/embeddings"):
        got = httpx.get(fast.url + path, headers=AUTH, timeout=30)
        want = httpx.get(plain.url + path, headers=AUTH, timeout=30)
        assert got.status_code == want.status_code == 405



def test_a_body_that_stops_arriving_is_answered_as_fastapi(pair):
    """Cut off mid-body, the request never reaches validation: the fast route must still answer
    FastAPI's 503 with Retry-After (not a 500 from the middleware)."""
    fast, plain = pair

    async def call(app: Any, path: str) -> tuple[int, str, str]:
        messages = [{"type": "http.request", "body": b'{"query": ', "more_body": True}, {"type": "http.disconnect"}]
        sent: list[dict] = []

        async def receive() -> dict:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(m: dict) -> None:
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {SEARCH}".encode())],
                 "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": "",
                 "app": app}
        await asyncio.wait_for(app(scope, receive, send), 10)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        error = body["error"]["code"] if isinstance(body["error"], dict) else body["error"]
        return start["status"], error, dict(start["headers"]).get(b"retry-after", b"").decode()

    for path in ("/v1/search", "/v1/embeddings"):
        got, want = asyncio.run(call(fast.app, path)), asyncio.run(call(plain.app, path))
        assert got == want == (503, "not_ready", "1")
