"""The OpenAI- and TEI-compatible routes and the search additions, over HTTP against a real
uvicorn server, a real index and real encoders; vectors are compared with the encoders' own."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from qswap.errors import error_from_body
from qswap.matryoshka import truncate
from qswap.server.http.compat_models import ModelList
from qswap.answers import EmbeddingResponse

from .conftest import ADMIN

QUERIES = ["chess puzzle game", "linux network server", "audio video music"]


@pytest.fixture(scope="module")
def admin(live):
    with live.client(ADMIN) as c:
        for d in ("ft1", "ft2"):
            assert c.post("/v1/encoders", json={"path": d}).status_code in (200, 201)
        assert c.put("/v1/aliases/games", json={"encoder": "ft@1"}).status_code == 200
        yield c


@pytest.fixture(scope="module")
def anon(live, admin):
    with live.client() as c:
        yield c


def _code(r) -> str:
    """The qswap error code of an answer, in whichever dialect its route speaks."""
    return error_from_body(r.status_code, r.json()).code


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _vectors(body: dict) -> np.ndarray:
    EmbeddingResponse.model_validate(body)   # exactly OpenAI's shape
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


@pytest.mark.parametrize("model,key", [("ft@1", "ft@1"), ("ft", "ft@2"), ("games", "ft@1"), ("base", "base")])
def test_embeddings_equal_the_query_encoder(anon, reference_pool, tiny_base, model, key):
    r = anon.post("/v1/embeddings", json={"input": QUERIES, "model": model})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == key
    want = reference_pool.encode(QUERIES, [key] * len(QUERIES))
    assert _cos(_vectors(body), want).min() >= 0.99999
    tokens = sum(len(e.ids) for e in tiny_base.tokenizer.encode_batch([tiny_base.spec.query_prefix + q
                                                                       for q in QUERIES]))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_documents_model_is_the_document_tower(anon, tiny_base):
    for path in ("/v1/embeddings", "/embeddings"):
        r = anon.post(path, json={"input": QUERIES[0], "model": "qswap/documents"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "qswap/documents"
        assert _cos(_vectors(r.json())[0], tiny_base.encode_documents([QUERIES[0]])[0]) >= 0.99999


def test_dimensions_and_base64(anon, reference_pool):
    full = reference_pool.encode(QUERIES, ["ft@1"] * 3)
    r = anon.post("/v1/embeddings", json={"input": QUERIES, "model": "ft@1", "dimensions": 8,
                                          "encoding_format": "base64", "user": "someone"})
    assert r.status_code == 200, r.text
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    assert got.shape == (3, 8)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)   # renormalised
    assert _cos(got, truncate(full, 8)).min() >= 0.99999


def test_a_thousand_inputs_in_one_call(anon, reference_pool):
    texts = [f"{QUERIES[i % 3]} {i}" for i in range(1000)]   # 16 chunks of max_batch=64
    r = anon.post("/v1/embeddings", json={"input": texts, "model": "ft@2"})
    assert r.status_code == 200, r.text
    assert _cos(_vectors(r.json()), reference_pool.encode(texts, ["ft@2"] * 1000)).min() >= 0.99999


@pytest.mark.parametrize("body,status,code", [
    ({"input": [[101, 2023]], "model": "ft@1"}, 400, "invalid_input"),
    ({"input": [101, 2023], "model": "ft@1"}, 400, "invalid_input"),
    ({"input": "x", "model": "nope"}, 404, "not_found"),
    ({"input": "x", "model": "ft@1", "dimensions": 33}, 422, "limit_exceeded"),
    ({"input": ["x"] * 2049, "model": "ft@1"}, 422, "limit_exceeded"),
    ({"input": "x", "model": "ft@1", "encoding_format": "int8"}, 422, "validation_error"),
    ({"input": [], "model": "ft@1"}, 422, "validation_error"),
    ({"input": "", "model": "ft@1"}, 422, "validation_error"),
    ({"input": "x"}, 422, "validation_error"),
])
def test_embedding_refusals(anon, body, status, code):
    r = anon.post("/v1/embeddings", json=body)
    assert (r.status_code, _code(r)) == (status, code), r.text
    if code == "invalid_input":
        assert "check_embedding_ctx_length=False" in r.json()["hint"]


def test_embeddings_keep_the_request_deadline(anon):
    r = anon.post("/v1/embeddings", json={"input": ["chess"] * 1000, "model": "ft@1"},
                  headers={"X-Request-Timeout": "0.0001"})
    assert (r.status_code, _code(r)) == (504, "deadline_exceeded")
    assert anon.post("/v1/embeddings", json={"input": "chess", "model": "ft@1"}).status_code == 200


def test_embeddings_are_counted(anon):
    anon.post("/v1/embeddings", json={"input": ["a", "b"], "model": "ft@1"})
    text = anon.get("/metrics").text
    assert 'qswap_embedded_inputs_total{encoder="ft@1"}' in text
    assert 'route="/v1/embeddings"' in text


def test_models(anon):
    body = anon.get("/v1/models").json()
    ModelList.model_validate(body)
    cards = {m["id"]: m for m in body["data"]}
    assert {"qswap/documents", "base", "ft@1", "ft@2", "games"} <= set(cards)
    assert cards["qswap/documents"]["kind"] == "documents"
    assert cards["games"]["kind"] == "alias" and cards["games"]["encoder"] == "ft@1"
    assert cards["ft@1"]["kind"] == "lora" and cards["ft@1"]["owned_by"] == "qswap"
    assert cards["ft@1"]["guard_status"] == "unguarded" and cards["ft@1"]["runtime"] in ("onnx-shared", "torch")
    assert all(m["object"] == "model" and m["dimensions"] == 32 for m in body["data"])
    assert anon.get("/v1/models/qswap/documents").json()["kind"] == "documents"
    assert anon.get("/v1/models/ft").json()["encoder"] == "ft@2"
    assert anon.get("/v1/models/games").json()["encoder"] == "ft@1"
    r = anon.get("/v1/models/nope")
    assert (r.status_code, _code(r)) == (404, "not_found")


def test_tei_embed_and_info(anon, reference_pool, tiny_base):
    r = anon.post("/tei/games/embed", json={"inputs": QUERIES[0]})
    assert r.status_code == 200, r.text
    assert _cos(np.array(r.json()), reference_pool.encode(QUERIES[:1], ["ft@1"])).min() >= 0.99999
    r = anon.post("/tei/ft@1/embed", json={"inputs": QUERIES, "prompt_name": "passage", "dimensions": 16,
                                           "normalize": True})
    assert _cos(np.array(r.json()), truncate(tiny_base.encode_documents(QUERIES), 16)).min() >= 0.99999
    long = " ".join(["chess"] * 200)   # past the tiny model's 64 tokens
    r = anon.post("/tei/ft@1/embed", json={"inputs": [long]})
    assert (r.status_code, _code(r)) == (422, "limit_exceeded")
    assert anon.post("/tei/ft@1/embed", json={"inputs": [long], "truncate": True}).status_code == 200
    info = anon.get("/tei/games/info").json()
    assert info["model_id"] == "ft@1" and info["max_input_length"] == 64
    assert info["max_client_batch_size"] == 2048
    assert anon.get("/tei/nope/info").status_code == 404


def test_search_offset_and_score_threshold(anon):
    q = {"query": "chess puzzle game", "encoder": "ft@1"}
    top = anon.post("/v1/search", json={**q, "k": 6}).json()["results"][0]["hits"]
    page = anon.post("/v1/search", json={**q, "k": 3, "offset": 3}).json()["results"][0]["hits"]
    assert [h["id"] for h in page] == [h["id"] for h in top[3:6]]
    cut = top[2]["score"]
    kept = anon.post("/v1/search", json={**q, "k": 6, "score_threshold": cut}).json()["results"][0]["hits"]
    assert [h["id"] for h in kept] == [h["id"] for h in top if h["score"] >= cut]
    assert len(kept) == 3 or top[3]["score"] == cut
    r = anon.post("/v1/search", json={**q, "offset": 21})
    assert (r.status_code, _code(r)) == (422, "limit_exceeded")
