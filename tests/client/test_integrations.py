"""The clients users already run, unmodified, against a real qswap server with the real
multilingual-e5-small: the official ``openai`` package, LangChain's ``OpenAIEmbeddings``,
LlamaIndex's OpenAI-compatible and TEI embedding classes, and qswap's own retrievers for
LangChain and LlamaIndex in a small RAG flow (20 documents indexed through the client)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from qswap.client import Client

from ..encoders.adapters import make_lora
from ..server.conftest import ADMIN, LiveServer, server_settings

pytestmark = pytest.mark.slow

MODEL = "multilingual-e5-small"
DOCS = {
    "chess": "Chess engine that analyses openings, endgames and tactical puzzles.",
    "audio": "Audio player for music playlists, podcasts and internet radio streams.",
    "fonts": "Collection of TrueType fonts for typesetting documents and web pages.",
    "backup": "Incremental backup tool that copies files to remote storage every night.",
    "mail": "Email client with encrypted messages, filters and a calendar.",
    "python": "Interpreter for the Python programming language and its standard library.",
    "firewall": "Firewall that filters network packets and blocks intrusions.",
    "weather": "Weather forecast service showing rain, wind and temperatures for your city.",
    "photo": "Photo editor to crop, retouch and apply filters to pictures.",
    "maps": "Offline maps and turn-by-turn navigation for hiking and cycling.",
    "compiler": "C and C++ compiler producing optimised machine code.",
    "database": "Relational database server with SQL queries, indexes and transactions.",
    "spell": "Spell checker for dictionaries in many languages.",
    "pdf": "PDF viewer with annotations, bookmarks and full-text search.",
    "games": "Arcade games with spaceships, asteroids and high scores.",
    "printer": "Printer drivers and a print queue manager for laser and inkjet printers.",
    "clock": "Alarm clock, stopwatch and countdown timer for the desktop.",
    "chat": "Instant messaging and video calls with friends and groups.",
    "math": "Computer algebra system for symbolic integration and equation solving.",
    "recipes": "Cookbook application for recipes, ingredients and shopping lists.",
}
QUERIES = {"how do I solve chess puzzles": "chess", "listen to internet radio": "audio",
           "block network intrusions": "firewall", "cook dinner from a recipe": "recipes"}


@pytest.fixture(scope="module")
def e5():
    from qswap.encoders import load_base
    return load_base(MODEL, device="cpu")


@pytest.fixture(scope="module")
def e5_server(tmp_path_factory, e5) -> Iterator[LiveServer]:
    from qswap.index import build_index
    tmp = tmp_path_factory.mktemp("e5")
    corpus = tmp / "seed.jsonl"
    corpus.write_text(json.dumps({"id": "seed", "text": "placeholder"}) + "\n")
    build_index(corpus, tmp / "idx", e5.encode_documents, e5.space, progress=False).close()
    root = tmp / "encoders"
    make_lora(e5, root / "legal", "legal", seed=3)
    s = server_settings(tmp, Path(e5.path), tmp / "idx", model=MODEL, encoders_root=root, admin_token=ADMIN,
                        backend="torch")
    with LiveServer(s) as srv:
        with Client(srv.url, ADMIN) as c:
            c.register_path("legal")
            c.set_alias("docs", "base")
            c.set_alias("legal", "legal@1")
            c.upsert_documents([{"id": k, "text": t, "metadata": {"topic": k}} for k, t in DOCS.items()])
            c.delete_documents(["seed"])
        yield srv


@pytest.fixture(scope="module")
def reference(e5, e5_server):
    """qswap's own encoders, in process: what every client must get."""
    from qswap.encoders import EncoderPool, load_encoder
    pool = EncoderPool(e5)
    pool.add(load_encoder(Path(e5_server.app.state.qs.settings.encoders_root) / "legal", e5.space))
    return pool


def _cos(a, b) -> np.ndarray:
    a, b = np.atleast_2d(np.asarray(a, dtype=np.float64)), np.atleast_2d(np.asarray(b, dtype=np.float64))
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _vecs(r) -> np.ndarray:
    """The vectors of an openai answer: asked-for base64 stays a string in the SDK (it decodes
    only the base64 it asked for itself), so decode it here."""
    import base64
    return np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if isinstance(d.embedding, str)
                     else np.asarray(d.embedding) for d in r.data])


def _prefix(v: np.ndarray, d: int) -> np.ndarray:
    from qswap.matryoshka import truncate
    return truncate(np.asarray(v, dtype=np.float32), d)


def test_openai_sdk(e5_server, reference, e5):
    import openai
    client = openai.OpenAI(base_url=f"{e5_server.url}/v1", api_key="unused", max_retries=0)
    texts = list(QUERIES)
    lora = reference.encode(texts, ["legal@1"] * len(texts))
    docs = e5.encode_documents(list(DOCS.values())[:3])
    for fmt in ("float", "base64"):
        r = client.embeddings.create(model="legal", input=texts, encoding_format=fmt)
        assert r.model == "legal@1" and r.usage.prompt_tokens > len(texts)
        assert _cos(_vecs(r), lora).min() >= 0.99999
        r = client.embeddings.create(model="legal@1", input=texts, encoding_format=fmt, dimensions=128)
        assert _vecs(r).shape == (len(texts), 128)
        assert _cos(_vecs(r), _prefix(lora, 128)).min() >= 0.99999
        r = client.embeddings.create(model="qswap/documents", input=list(DOCS.values())[:3], encoding_format=fmt,
                                     dimensions=64)
        assert _cos(_vecs(r), _prefix(docs, 64)).min() >= 0.99999
    r = client.embeddings.create(model="legal@1", input=texts[0])   # the SDK's own default format
    assert _cos(r.data[0].embedding, lora[0]).min() >= 0.99999
    assert {"legal@1", "docs", "qswap/documents"} <= {m.id for m in client.models.list()}
    assert client.models.retrieve("docs").encoder == "base"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="legal@1", input=[[9906, 1917]])   # token ids
    assert "check_embedding_ctx_length=False" in e.value.response.json()["hint"]


def test_langchain_openai_embeddings(e5_server, reference, e5):
    from langchain_openai import OpenAIEmbeddings
    emb = OpenAIEmbeddings(model="legal@1", base_url=f"{e5_server.url}/v1", api_key="unused",
                           check_embedding_ctx_length=False)
    q = next(iter(QUERIES))
    assert _cos(emb.embed_query(q), reference.encode([q], ["legal@1"])[0]).min() >= 0.99999
    docs = OpenAIEmbeddings(model="qswap/documents", base_url=f"{e5_server.url}/v1", api_key="unused",
                            check_embedding_ctx_length=False, dimensions=128)
    got = docs.embed_documents(list(DOCS.values())[:4])
    assert _cos(got, _prefix(e5.encode_documents(list(DOCS.values())[:4]), 128)).min() >= 0.99999


def test_llamaindex_embeddings(e5_server, reference, e5):
    from llama_index.embeddings.openai import OpenAIEmbedding
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference
    q = next(iter(QUERIES))
    want = reference.encode([q], ["legal@1"])[0]
    oa = OpenAIEmbedding(model_name="legal@1", api_base=f"{e5_server.url}/v1", api_key="unused")
    assert _cos(oa.get_query_embedding(q), want).min() >= 0.99999
    tei = TextEmbeddingsInference(model_name="qswap", base_url=f"{e5_server.url}/tei/legal@1")
    assert _cos(tei.get_query_embedding(q), want).min() >= 0.99999
    texts = list(DOCS.values())[:3]
    assert _cos(tei.get_text_embedding_batch(texts), reference.encode(texts, ["legal@1"] * 3)).min() >= 0.99999


def test_rag_with_each_retriever(e5_server):
    from qswap.client.langchain import QswapRetriever as LangChainRetriever
    from qswap.client.llamaindex import QswapRetriever as LlamaIndexRetriever
    lc = LangChainRetriever(url=e5_server.url, encoder="base", k=3)
    li = LlamaIndexRetriever(e5_server.url, domain="docs", k=3)
    for query, expected in QUERIES.items():
        docs = lc.invoke(query)
        assert docs[0].id == expected and docs[0].page_content == DOCS[expected]
        assert docs[0].metadata["topic"] == expected and docs[0].metadata["encoder"] == "base"
        assert docs[0].metadata["score"] >= docs[1].metadata["score"]
        nodes = li.retrieve(query)
        assert nodes[0].node.node_id == expected and nodes[0].node.metadata["encoder"] == "base"
        assert nodes[0].score >= nodes[1].score
    filtered = LangChainRetriever(url=e5_server.url, k=3, filter={"topic": "maps"}).invoke("chess")
    assert [d.id for d in filtered] == ["maps"]
    q, expected = next(iter(QUERIES.items()))
    assert asyncio.run(lc.ainvoke(q))[0].id == expected
    assert asyncio.run(li.aretrieve(q))[0].node.node_id == expected


def _ranks_as_search(url: str, query: str, got: list[str]) -> bool:
    """``got`` is /v1/search's top-10 for ``query`` on domain legal: the same ids in the same
    order, where a swap is allowed only between hits whose search scores are within 1e-4 (the
    two paths' float32 sums differ by ~1e-5, and near-ties exist among 20 short documents)."""
    with Client(url) as c:
        hits = c.search(query, domain="legal", k=11).results[0].hits
    score = {h.id: h.score for h in hits}
    return len(got) == 10 and len(set(got)) == 10 and all(
        g in score and abs(score[g] - h.score) <= 1e-4 for g, h in zip(got, hits))


def test_langchain_vector_store_ranks_as_search(e5_server, reference, e5):
    """QswapEmbeddings keeps the towers apart: LangChain's own InMemoryVectorStore, filled through
    it, returns the same top-10 as /v1/search with the same domain; the query-encoder way of
    OpenAIEmbeddings(model="legal") puts documents in another space."""
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import OpenAIEmbeddings

    from qswap.client.langchain import QswapEmbeddings
    emb = QswapEmbeddings(url=e5_server.url, model="legal")
    texts = list(DOCS.values())
    assert _cos(emb.embed_documents(texts[:3]), e5.encode_documents(texts[:3])).min() >= 0.99999
    q = next(iter(QUERIES))
    assert _cos(emb.embed_query(q), reference.encode([q], ["legal@1"])[0]).min() >= 0.99999
    store = InMemoryVectorStore(emb)
    store.add_texts(texts, ids=list(DOCS))
    for query in QUERIES:
        assert _ranks_as_search(e5_server.url, query, [d.id for d in store.similarity_search(query, k=10)])
    got = asyncio.run(store.asimilarity_search(q, k=10))
    assert _ranks_as_search(e5_server.url, q, [d.id for d in got])
    wrong = OpenAIEmbeddings(model="legal", base_url=f"{e5_server.url}/v1", api_key="unused",
                             check_embedding_ctx_length=False).embed_documents(texts[:3])
    assert _cos(wrong, e5.encode_documents(texts[:3])).max() < 0.99


def test_llamaindex_vector_store_ranks_as_search(e5_server, reference, e5):
    """QswapEmbedding: LlamaIndex's in-memory VectorStoreIndex returns the same top-10 as /v1/search."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode

    from qswap.client.llamaindex import QswapEmbedding
    emb = QswapEmbedding("legal", url=e5_server.url)
    texts = list(DOCS.values())
    assert _cos(emb.get_text_embedding_batch(texts[:3]), e5.encode_documents(texts[:3])).min() >= 0.99999
    q = next(iter(QUERIES))
    assert _cos(emb.get_query_embedding(q), reference.encode([q], ["legal@1"])[0]).min() >= 0.99999
    index = VectorStoreIndex([TextNode(id_=k, text=t) for k, t in DOCS.items()], embed_model=emb)
    retriever = index.as_retriever(similarity_top_k=10)
    for query in QUERIES:
        assert _ranks_as_search(e5_server.url, query, [n.node.node_id for n in retriever.retrieve(query)])
    got = asyncio.run(retriever.aretrieve(q))
    assert _ranks_as_search(e5_server.url, q, [n.node.node_id for n in got])


def test_docs_page_snippets_run(e5_server):
    """Every python and bash block of docs/integrations.md, run as written (the URL swapped for
    this server's) from a folder holding encoders/legal."""
    import os
    import re
    import subprocess
    import sys
    page = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    blocks = re.findall(r"```(python|bash)\n(.*?)```", page, flags=re.S)
    assert [lang for lang, _ in blocks].count("python") >= 4 and ("bash" in dict(blocks))
    cwd = Path(e5_server.app.state.qs.settings.encoders_root).parent
    env = {**os.environ, "QSWAP_ADMIN_TOKEN": ADMIN}
    for lang, code in blocks:
        code = code.replace("http://127.0.0.1:8000", e5_server.url)
        cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{lang} block failed:\n{code}\n{r.stderr[-2000:]}"
        assert r.stdout.strip(), code
