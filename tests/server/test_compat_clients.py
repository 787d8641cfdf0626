"""The compatibility routes as their own clients call them: the official ``openai`` package reads
qswap's errors (code, message, retry or not), ``huggingface_hub``'s ``InferenceClient`` embeds
through TEI's root route, and lenient bodies (unknown fields, ``null`` options, TEI's truncation
fields and prompt names) are read as the anchors read them. A real uvicorn server, tiny models."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from qswap.matryoshka import truncate

from .conftest import ADMIN, LiveServer, server_settings
from .test_compat_routes import _cos, admin, anon  # noqa: F401  (the same module fixtures: two encoders, an alias)
from .guarding import GuardGate, build_guard_data, wait_verdict

QUERIES = ["chess puzzle game", "linux network server", "audio video music"]


def _openai(url: str, max_retries: int = 0, hooks: list | None = None):
    import openai
    http = httpx.Client(event_hooks={"request": hooks or []})
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=max_retries, http_client=http)


@pytest.mark.parametrize("kwargs,error,code,says", [
    ({"model": "nope", "input": "x"}, "NotFoundError", "not_found", "nope"),
    ({"model": "ft@1", "input": ["x"] * 2049}, "UnprocessableEntityError", "limit_exceeded", "2049"),
    ({"model": "ft@1", "input": "x", "dimensions": 999}, "UnprocessableEntityError", "limit_exceeded", "999"),
])
def test_openai_sdk_errors_name_the_cause(live, admin, kwargs, error, code, says):
    import openai
    with pytest.raises(getattr(openai, error)) as caught:
        _openai(live.url).embeddings.create(**kwargs)
    e = caught.value
    assert e.code == code and e.type == "invalid_request_error"
    assert says in e.message and "hint:" in e.message, e.message


def test_openai_sdk_validation_error_names_the_param(live, admin):
    import openai
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        _openai(live.url).embeddings.create(model="ft@1", input="x", encoding_format="int8")  # type: ignore[arg-type]
    assert caught.value.code == "validation_error" and caught.value.param == "encoding_format"


def test_lenient_bodies_are_read_as_openai_and_tei_read_them(anon, reference_pool):
    want = reference_pool.encode(QUERIES, ["ft@1"] * 3)
    r = anon.post("/v1/embeddings", json={"input": QUERIES, "model": "ft@1", "input_type": "query",
                                          "encoding_format": None, "dimensions": None, "user": None})
    assert r.status_code == 200, r.text
    assert _cos([d["embedding"] for d in r.json()["data"]], want).min() >= 0.99999
    r = anon.post("/tei/ft@1/embed", json={"inputs": QUERIES, "truncate": None, "normalize": None,
                                           "prompt_name": None, "dimensions": None, "something_new": 1})
    assert r.status_code == 200, r.text
    assert _cos(r.json(), want).min() >= 0.99999
    r = anon.post("/v1/embeddings", json={"input": "x", "model": None})   # a required field stays required
    assert r.status_code == 422 and r.json()["error"]["param"] == "model"


def test_tei_root_route_and_huggingface_hub(live, anon, reference_pool):
    from huggingface_hub import InferenceClient
    want = reference_pool.encode(QUERIES[:1], ["ft@1"])
    for path in ("/tei/games", "/tei/games/"):
        r = anon.post(path, json={"inputs": QUERIES[0]})
        assert r.status_code == 200, (path, r.text)
        assert _cos(r.json(), want).min() >= 0.99999
    got = InferenceClient(model=f"{live.url}/tei/games").feature_extraction(QUERIES[0])
    assert _cos(np.asarray(got).reshape(1, -1), want).min() >= 0.99999


def test_tei_health_tokenize_decode(anon, tiny_base):
    assert anon.get("/tei/games/health").status_code == 200
    r = anon.get("/tei/nope/health")
    assert r.status_code == 404 and r.json()["error_type"] == "Validation" and r.json()["code"] == "not_found"
    toks = anon.post("/tei/games/tokenize", json={"inputs": ["chess puzzle", "audio"]}).json()
    enc = tiny_base.tokenizer.encode("chess puzzle")
    assert [t["id"] for t in toks[0]] == enc.ids
    assert toks[0][0]["special"] and toks[0][0]["start"] is None
    words = [t for t in toks[0] if not t["special"]]
    assert "chess puzzle"[words[0]["start"]:words[-1]["stop"]] == "chess puzzle"
    plain = anon.post("/tei/games/tokenize", json={"inputs": "chess", "add_special_tokens": False}).json()
    assert not any(t["special"] for t in plain[0])
    prompted = anon.post("/tei/games/tokenize", json={"inputs": "chess", "prompt_name": "query"}).json()
    assert [t["id"] for t in prompted[0]] == tiny_base.tokenizer.encode(tiny_base.spec.query_prefix + "chess").ids
    text = anon.post("/tei/games/decode", json={"ids": enc.ids}).json()
    assert text == [tiny_base.tokenizer.decode(enc.ids)]
    r = anon.post("/tei/games/decode", json={"ids": [[10 ** 7]], "skip_special_tokens": False})
    assert r.status_code == 200 and r.json() == [tiny_base.tokenizer.decode([tiny_base.tokenizer.token_to_id("[UNK]")],
                                                                            skip_special_tokens=False)]


def test_tei_truncation_left_keeps_the_tail_and_prompt_names(anon, reference_pool, tiny_base):
    from qswap.server.http.routes.tei import keep_tail
    long = "chess puzzle game " * 40 + "linux network server audio video music"   # past 64 tokens
    for side in ("left", "Left"):
        r = anon.post("/tei/ft@1/embed", json={"inputs": [long], "truncate": True, "truncation_direction": side})
        assert r.status_code == 200, r.text
    tail = keep_tail(tiny_base.tokenizer, [long], tiny_base.spec.query_prefix, 64)[0]
    assert long.endswith(tail) and len(tail) < len(long)
    assert not tiny_base.tokenizer.encode(tiny_base.spec.query_prefix + tail).overflowing   # it fits whole
    assert _cos(r.json(), reference_pool.encode([tail], ["ft@1"])).min() >= 0.99999
    head = anon.post("/tei/ft@1/embed", json={"inputs": [long], "truncate": True}).json()
    assert _cos(head, r.json())[0] < 0.9999   # the default (right) cut reads the start instead
    want = tiny_base.encode_documents(QUERIES)
    for name in ("passage", "document"):
        r = anon.post("/tei/ft@1/embed", json={"inputs": QUERIES, "prompt_name": name})
        assert _cos(r.json(), want).min() >= 0.99999
    r = anon.post("/tei/ft@1/embed", json={"inputs": QUERIES, "prompt_name": "summarize"})
    assert r.status_code == 422 and "prompt_name" in r.json()["error"]
    r = anon.post("/tei/ft@1/embed", json={"inputs": QUERIES, "dimensions": 16})
    assert _cos(r.json(), truncate(reference_pool.encode(QUERIES, ["ft@1"] * 3), 16)).min() >= 0.99999


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_base, tiny_model_dir):
    d = build_guard_data(tmp_path_factory.mktemp("sdk-guard"), tiny_base)
    tmp = tmp_path_factory.mktemp("sdk-guard-state")
    s = server_settings(tmp, tiny_model_dir, d["index"], encoders_root=d["root"], admin_token=ADMIN,
                        sentinels=d["sentinels"], read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        yield srv, c


def test_openai_sdk_pending_and_refused_encoders(guarded):
    """A pending verdict may change: the SDK is told to retry after a pause. A refusal will not:
    the SDK raises at once, without the retries it makes for a bare 409."""
    import openai
    srv, c = guarded
    sent: list[str] = []
    with GuardGate(srv.app.state.qs.guard) as gate:
        assert c.post("/v1/encoders", json={"path": "bad1"}).status_code == 202 and gate.entered.wait(60)
        r = c.post("/v1/embeddings", json={"model": "bad@1", "input": "chess"})
        assert r.headers["x-should-retry"] == "true" and int(r.headers["retry-after"]) >= 1
        with pytest.raises(openai.ConflictError) as caught:
            _openai(srv.url).embeddings.create(model="bad@1", input="chess")
        assert caught.value.code == "guard_pending" and "bad@1" in caught.value.message
    assert wait_verdict(srv, c, "bad@1")["guard_status"] == "refused"
    with pytest.raises(openai.ConflictError) as caught:
        _openai(srv.url, max_retries=3, hooks=[lambda request: sent.append(request.url.path)]).embeddings.create(
            model="bad@1", input="chess")
    assert caught.value.code == "guard_refused" and len(sent) == 1
