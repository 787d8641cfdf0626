"""The cost gate: every route that runs the model is token-bounded, sliced between other
requests, dropped at its deadline and dropped when its client goes away, the same way.

Ordering between the event loop and the batch worker uses events and semaphores, never sleeps.
"""

from __future__ import annotations

import inspect
import json
import shutil
import socket
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from qswap.server.serving.batching import INLINE_CHARS
from qswap.server.traffic.abandoned import AbandonedWork

from ..counting import CountingTokenizer
from .conftest import ADMIN, LiveServer, server_settings

LONG = " ".join(["chess game music"] * 30)   # ~64 tokens: the tiny model's max length

# Every route that runs the model, with a request over the 400-token bound below (8 x ~64 tokens).
OVER_THE_BOUND: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/search"): {"queries": [LONG] * 8},
    ("POST", "/v1/embeddings"): {"model": "base", "input": [LONG] * 8},
    ("POST", "/embeddings"): {"model": "qswap/documents", "input": [LONG] * 8},
    ("POST", "/tei/{encoder}/embed"): {"inputs": [LONG] * 8, "truncate": True, "prompt_name": "passage"},
    ("POST", "/tei/{encoder}"): {"inputs": [LONG] * 8, "truncate": True},
    ("POST", "/tei/{encoder}/"): {"inputs": [LONG] * 8, "truncate": True},
}
# Model routes whose work is a background job (bounded by max_documents, sliced the same way).
JOBS = {("POST", "/v1/documents")}
# Routes that need the server ready but never run the model themselves.
NO_MODEL = {("GET", "/v1/models"), ("GET", "/v1/models/{model_id:path}"), ("GET", "/tei/{encoder}/info"),
            ("GET", "/v1/encoders"), ("GET", "/v1/encoders/{ref}"), ("DELETE", "/v1/encoders/{ref}"),
            ("GET", "/v1/aliases"), ("PUT", "/v1/aliases/{domain}"), ("DELETE", "/v1/aliases/{domain}"),
            ("DELETE", "/v1/documents"), ("POST", "/v1/feedback"), ("POST", "/v1/experiments"),
            ("GET", "/v1/experiments"), ("GET", "/v1/experiments/{domain}"),
            ("POST", "/v1/experiments/{domain}/{action}"), ("GET", "/v1/info"),
            # the tokenizer only
            ("GET", "/tei/{encoder}/health"), ("POST", "/tei/{encoder}/tokenize"), ("POST", "/tei/{encoder}/decode"),
            # a registration's guard evaluation is background work on the guard thread
            ("POST", "/v1/encoders")}


def _routes() -> list[Any]:
    from fastapi.routing import APIRoute

    from qswap.server.http.app import create_app
    from qswap.server.config import ServerSettings
    app = create_app(ServerSettings.model_construct(), check=False)
    # included routers are kept whole (FastAPI >= 0.160): walk into them
    routers = [getattr(r, "original_router", None) for r in app.routes]
    routes = [r for router in routers if router is not None for r in router.routes if isinstance(r, APIRoute)]
    assert len(routes) > 20
    return routes


def _calls(dependant: Any) -> Iterator[Callable[..., Any]]:
    for dep in dependant.dependencies:
        yield dep.call
        yield from _calls(dep)


def test_every_route_that_runs_the_model_passes_the_gate():
    """A route that needs the ready server either takes an Admission or is listed as not running
    the model; every gated route has its over-the-bound request below (or is a job). The batch
    worker refuses work without a ticket, so a route cannot run the model around the gate."""
    from qswap.server.http.auth import require_admin
    from qswap.server.http.responses import ready_state
    from qswap.server.serving.batching import MicroBatcher
    from qswap.server.serving.gate import admission, search_admission

    gated = set()
    for route in _routes():
        deps = set(_calls(route.dependant))
        for method in route.methods:
            if search_admission in deps or admission in deps:
                # The plain admission checks no token: its route's own auth dependency does.
                assert search_admission in deps or require_admin in deps, f"{method} {route.path}: no auth"
                gated.add((method, route.path))
            elif ready_state in deps:
                assert (method, route.path) in NO_MODEL, f"{method} {route.path} needs the server, takes no Admission"
    assert gated == set(OVER_THE_BOUND) | JOBS | {("POST", "/embeddings"), ("POST", "/v1/embeddings")}
    for fn in (MicroBatcher.search, MicroBatcher.embed):
        p = inspect.signature(fn).parameters["ticket"]
        assert p.kind is p.KEYWORD_ONLY and p.default is p.empty, fn


@pytest.fixture(scope="module")
def gated(tmp_path_factory, tiny_model_dir, index_dir) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("gated")
    shutil.copytree(index_dir, tmp / "index")
    s = server_settings(tmp, tiny_model_dir, tmp / "index", admin_token=ADMIN, backend="torch",
                        max_request_tokens=400, max_batch_tokens=256, slice_tokens=64, batch_window_ms=0.0,
                        abandon_wait_s=0.0)   # on in its own test: the other tests abandon and resend
    with LiveServer(s) as srv:
        yield srv


@pytest.mark.parametrize("route", sorted(OVER_THE_BOUND), ids=lambda r: r[1])
def test_a_request_over_the_token_bound_is_refused_alike_on_every_route(gated, route):
    method, path = route
    url = path.replace("{encoder}", "base")
    body = OVER_THE_BOUND[route]
    with gated.client() as c:
        r = c.request(method, url, json=body)
        # the same status and message everywhere, in each route family's error dialect
        assert r.status_code == 422 and "the limit per request is 400" in r.text, r.text
        within = json.loads(json.dumps(body).replace(json.dumps([LONG] * 8), json.dumps([LONG] * 3)))
        assert c.request(method, url, json=within).status_code == 200   # ~192 tokens: sliced, served


class _Gate:
    """Wraps an encode function: each call waits for a permit; calls are counted."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.sizes = fn, []
        self.entered = threading.Semaphore(0)
        self.permits = threading.Semaphore(0)

    def __call__(self, texts: list[str], *rest: Any, **kw: Any) -> Any:
        self.sizes.append(len(texts))
        self.entered.release()
        assert self.permits.acquire(timeout=30)
        return self.fn(texts, *rest, **kw)

    def open(self) -> None:
        for _ in range(1000):
            self.permits.release()


def _gate_documents(state: Any) -> _Gate:
    g = _Gate(state.embed_documents)
    state.embed_documents = g   # the batcher calls state.embed_documents late-bound
    return g


def _gate_queries(state: Any) -> _Gate:
    g = _Gate(state.batcher.forward.encode_fn)
    state.batcher.forward.encode_fn = g
    return g


def test_document_embeddings_are_sliced_and_a_search_runs_between_slices(gated):
    """``qswap/documents`` embeddings (and TEI passage) are batch jobs in token slices: a search
    that arrives while the first slice runs is answered before the second, not after all."""
    state = gated.app.state.qs
    real = state.embed_documents
    g = _gate_documents(state)
    texts = [f"chess {i}" for i in range(30)]
    out: list[httpx.Response] = []
    try:
        with gated.client() as c, gated.client() as other:
            worker = threading.Thread(target=lambda: out.append(
                c.post("/v1/embeddings", json={"model": "qswap/documents", "input": texts})), daemon=True)
            worker.start()
            assert g.entered.acquire(timeout=30)                    # slice 1 is on the worker
            found: list[httpx.Response] = []
            searcher = threading.Thread(target=lambda: found.append(other.post("/v1/search", json={"query": "chess"})),
                                        daemon=True)
            searcher.start()
            # The search is queued behind slice 1, or (a large request's slices run on the bulk
            # lane) already answered beside it: either way not after every slice.
            _until(lambda: state.batcher.pending >= 2 or bool(found))
            g.permits.release()                                      # slice 1 ends; the search runs next
            searcher.join(30)
            assert found and found[0].status_code == 200
            assert len(g.sizes) <= 2                                 # at most slice 2 started meanwhile
            g.open()
            worker.join(30)
    finally:
        g.open()
        state.embed_documents = real
    assert out and out[0].status_code == 200 and len(out[0].json()["data"]) == 30
    assert len(g.sizes) > 2 and max(g.sizes) < 30 and sum(g.sizes) == 30


def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``cond`` (a state another thread changes) until it holds; fail after ``timeout``."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.002)


def _raw_post(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("path,body,gate", [
    ("/v1/search", {"queries": [f"{i} {LONG}" for i in range(6)], "k": 3}, _gate_queries),
    ("/v1/embeddings", {"model": "qswap/documents", "input": [f"chess {i}" for i in range(30)]}, _gate_documents),
], ids=["search", "documents"])
def test_an_abandoned_request_stops_at_its_next_slice(gated, path, body, gate):
    """The client closes the connection while slice 1 runs: the rest of the request never runs,
    and its encoder reference is given back."""
    state = gated.app.state.qs
    gone = state.metrics.rejected.labels(reason="client_gone")
    before = gone._value.get()
    real, real_queries = state.embed_documents, state.batcher.forward.encode_fn
    g = gate(state)
    try:
        sock = _raw_post(gated.port, path, body)
        assert g.entered.acquire(timeout=30)                        # slice 1 is on the worker
        sock.close()                                                 # the client goes away
        _until(lambda: gone._value.get() > before)                   # the gate saw the disconnect
        g.open()                                                     # slice 1 ends
        _until(lambda: state.batcher.pending == 0 and state.registry.in_flight("base") == 0)
    finally:
        g.open()
        state.embed_documents, state.batcher.forward.encode_fn = real, real_queries
    assert len(g.sizes) == 1, g.sizes                                # nothing after the slice that ran
    with gated.client() as c:                                        # and the server serves on
        assert c.post("/v1/search", json={"query": "chess"}).status_code == 200


def test_a_client_that_abandons_a_large_request_waits_before_its_next(gated):
    """After abandoning a request larger than one slice, the same client's next large requests
    (search, document embeddings) are refused with 429 and Retry-After before any forward pass;
    its one-slice searches are served meanwhile."""
    state = gated.app.state.qs
    real = state.batcher.forward.encode_fn
    large = {"queries": [f"{i} {LONG}" for i in range(6)], "k": 3}   # ~384 tokens: 6 slices
    state.settings.abandon_wait_s, state.abandoned = 20.0, AbandonedWork()
    g = _gate_queries(state)
    try:
        sock = _raw_post(gated.port, "/v1/search", large)
        assert g.entered.acquire(timeout=30)                         # slice 1 is on the worker
        sock.close()                                                 # the client goes away
        _until(lambda: state.abandoned.owed("addr:127.0.0.1") > 0)  # and owes for it
        g.open()
        _until(lambda: state.batcher.pending == 0)
        with gated.client() as c:
            r = c.post("/v1/search", json=large)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 19, r.text
            assert "abandoned a large request" in r.json()["detail"]
            docs = c.post("/v1/embeddings", json={"model": "qswap/documents", "input": ["chess"]})
            assert docs.status_code == 429, docs.text
            assert c.post("/v1/search", json={"query": "chess"}).status_code == 200   # one slice: served
    finally:
        g.open()
        state.batcher.forward.encode_fn = real
        state.settings.abandon_wait_s, state.abandoned = 0.0, AbandonedWork()
    assert len(g.sizes) == 2, g.sizes   # the abandoned slice and the one-slice search: nothing refused ran


def test_abandoned_work_is_owed_for_as_long_as_it_held_the_server():
    debts = AbandonedWork(max_clients=2, max_owed_s=10.0)
    debts.charge("a", 2.0, now=100.0)
    assert debts.owed("a", now=101.0) == 1.0 and debts.owed("b", now=101.0) == 0.0
    debts.charge("a", 3.0, now=101.0)                    # after what it owes already
    assert debts.owed("a", now=101.0) == 4.0
    debts.charge("a", 60.0, now=101.0)                   # at most max_owed_s from now
    assert debts.owed("a", now=101.0) == 10.0
    assert debts.owed("a", now=111.0) == 0.0             # paid: forgotten
    debts.charge("b", 1.0, now=200.0)
    debts.charge("c", 1.0, now=200.0)
    debts.charge("d", 1.0, now=200.0)                    # over max_clients: the least recently charged goes
    assert debts.owed("b", now=200.0) == 0.0 and debts.owed("d", now=200.0) == 1.0
    assert debts.refuse(4.2).retry_after == 5


@pytest.mark.parametrize("path,field,n,filler,extra", [
    ("/v1/search", "queries", 2, " chess game", {"k": 3}),
    # 7 long one-word texts: the gate cannot tell from their length that they are within the
    # bound, so it tokenises them itself; the batch job must reuse those encodings
    ("/v1/search", "queries", 7, "x" * 200, {"k": 3}),
    ("/v1/embeddings", "input", 2, " chess game", {"model": "base"}),
], ids=["search", "search-counted-by-the-gate", "embeddings"])
def test_a_request_is_tokenised_once(gated, path, field, n, filler, extra):
    """From the cost gate to the forward pass, each query goes through the tokenizer once: the
    encodings made to count it (by the gate or the tokens stage) are the ones encoded."""
    state = gated.app.state.qs
    real = state.base.tokenizer
    counting = CountingTokenizer(real)
    marks = [f"once{i}-{time.monotonic_ns()}" for i in range(n)]
    state.base.tokenizer = counting   # the one tokenizer object the gate, the worker and the backend read
    try:
        with gated.client() as c:
            r = c.post(path, json={field: [m + filler for m in marks], **extra})
    finally:
        state.base.tokenizer = real
    assert r.status_code == 200, r.text
    for m in marks:
        assert sum(m in t for t in counting.texts) == 1, (m, counting.texts)


def test_a_large_request_is_tokenised_off_the_tokens_stage(gated):
    """A request over INLINE_CHARS is tokenised on the bulk lane's low-priority thread, where
    one-query searches never queue behind it; a short query is not (the tokens stage tokenises
    it, or the forward lane when the server is idle)."""
    state = gated.app.state.qs
    real = state.base.tokenizer
    counting = CountingTokenizer(real)
    big = [f"{i} {LONG}" * (INLINE_CHARS // len(LONG) // 2) for i in range(3)]
    assert sum(map(len, big)) > INLINE_CHARS
    state.base.tokenizer = counting
    try:
        with gated.client() as c:
            assert c.post("/v1/search", json={"queries": big, "k": 3}).status_code == 200
            low = list(counting.threads)
            assert c.post("/v1/search", json={"query": "chess"}).status_code == 200
    finally:
        state.base.tokenizer = real
    assert low and all("bulk-tokens" in t for t in low), low
    assert counting.threads[len(low):] and all((t.endswith("-tokens") or t == state.batcher.thread.name)
                                               and "bulk" not in t for t in counting.threads[len(low):]), counting.threads
