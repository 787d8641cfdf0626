"""`qswap serve --index milvus://...`: a real uvicorn server over a real milvus-lite collection.

Search answers (with and without a filter) must be the brute-force top-k of the tiny base's
embeddings; document upserts and deletes go to the collection; an injected filter matches nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qswap.index.backends.milvus.build import build_collection

from ..server.conftest import ADMIN, LiveServer, make_docs, server_settings


def brute_force(q: np.ndarray, x: np.ndarray, ids: list[str], k: int) -> list[str]:
    s = x @ q
    return [ids[n] for n in sorted(range(len(ids)), key=lambda n: (-s[n], ids[n]))[:k]]


def test_serve_from_a_milvus_collection(tmp_path, tiny_model_dir, tiny_base):
    docs = make_docs(40)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    db = tmp_path / "docs.db"
    build_collection(corpus, str(db), "docs", tiny_base.encode_documents, tiny_base.space, progress=False).close()
    x = tiny_base.encode_documents([d["text"] for d in docs])
    ids = [d["id"] for d in docs]

    settings = server_settings(tmp_path, tiny_model_dir, f"milvus://{db}?collection=docs", admin_token=ADMIN)
    with LiveServer(settings) as srv, srv.client() as anon, srv.client(ADMIN) as admin:
        info = anon.get("/v1/info").json()
        assert info["index"]["backend"] == "milvus" and info["index"]["documents"] == 40
        q = "chess engine"
        qv = tiny_base.encode_queries([q])[0]
        r = anon.post("/v1/search", json={"query": q, "k": 5})
        assert r.status_code == 200, r.text
        assert [h["id"] for h in r.json()["results"][0]["hits"]] == brute_force(qv, x, ids, 5)

        sec = docs[0]["section"]
        keep = [n for n, d in enumerate(docs) if d["section"] == sec]
        r = anon.post("/v1/search", json={"query": q, "k": 5, "filter": {"section": sec}})
        assert [h["id"] for h in r.json()["results"][0]["hits"]] == brute_force(qv, x[keep], [ids[n] for n in keep], 5)
        r = anon.post("/v1/search", json={"query": q, "k": 5, "filter": {"section": 'x" or id > "" or "'}})
        assert r.status_code == 200 and r.json()["results"][0]["hits"] == []

        r = admin.post("/v1/documents", json={"documents": [{"id": "new1", "text": q, "metadata": {"section": "z"}}]})
        assert r.status_code == 200 and r.json()["count"] == 41, r.text
        r = anon.post("/v1/search", json={"query": q, "k": 1, "filter": {"section": "z"}})
        assert [h["id"] for h in r.json()["results"][0]["hits"]] == ["new1"]
        r = admin.request("DELETE", "/v1/documents", json={"ids": ["new1", ids[0]]})
        assert r.status_code == 200 and r.json() == {"deleted": 2, "count": 39}, r.text


BAD_METADATA = [{"n": 2 ** 80}, {"n": -(2 ** 63) - 1}, {"deep": {"a": [1, {"b": 2 ** 70}]}}]


def test_metadata_milvus_cannot_store_is_refused_at_the_edge_on_both_backends(tmp_path, tiny_model_dir, tiny_base):
    """Integers beyond 64 bits (top-level or nested) are a 422 on FAISS and Milvus alike, never a
    500 index_corrupt; nested metadata within range is stored by both."""
    from qswap.errors import InvalidInputError
    from qswap.index import Document, build_index
    from qswap.index.backends import open_index

    docs = make_docs(10)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    db = tmp_path / "docs.db"
    build_collection(corpus, str(db), "docs", tiny_base.encode_documents, tiny_base.space, progress=False).close()
    build_index(corpus, tmp_path / "faiss", tiny_base.encode_documents, tiny_base.space, progress=False).close()
    for n, index in enumerate((f"milvus://{db}?collection=docs", tmp_path / "faiss")):
        settings = server_settings(tmp_path / str(n), tiny_model_dir, index, admin_token=ADMIN)
        with LiveServer(settings) as srv, srv.client(ADMIN) as admin:
            for meta in BAD_METADATA:
                r = admin.post("/v1/documents", json={"documents": [{"id": "big", "text": "chess", "metadata": meta}]})
                assert r.status_code == 422 and r.json()["error"] == "validation_error", (index, meta, r.text)
                assert "64-bit" in r.json()["detail"]
            nested = {"deep": {"a": [1, {"b": -(2 ** 63)}]}, "f": 1.5e18, "tag": "kept"}
            r = admin.post("/v1/documents", json={"documents": [{"id": "ok", "text": "chess", "metadata": nested}]})
            assert r.status_code == 200, (index, r.text)
            r = admin.post("/v1/search", json={"query": "chess", "k": 1, "filter": {"tag": "kept"}})
            assert r.json()["results"][0]["hits"][0]["metadata"] == nested
    # Below the edge, the Milvus backend itself calls such data the caller's, not a damaged index.
    idx = open_index(f"milvus://{db}?collection=docs")
    try:
        with pytest.raises(InvalidInputError, match="refused the data"):
            idx.upsert([Document("big", "chess", BAD_METADATA[0])], tiny_base.encode_documents(["chess"]))
    finally:
        idx.close()
