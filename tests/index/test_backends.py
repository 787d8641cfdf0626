"""One conformance suite for every index backend: the FAISS folder and a real milvus-lite collection.

Same corpus, same queries, same filters; add / delete / upsert; reopen; space mismatch; bad
corpus lines; bad input. Results are checked against a NumPy brute-force reference, so both
backends are held to the same answers.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from qswap.errors import ConflictError, InvalidInputError, NotFoundError, SpaceMismatchError
from qswap.index import Document, IndexConfig, build_index, create_index
from qswap.index.backends import IndexBackend, open_index

from .conftest import doc_record, hash_embed, make_space, write_jsonl
from .test_milvus_expr import INJECTIONS

BACKENDS = ["faiss", "milvus", "milvus-server"]
INJECTION = 'x" or id > 0 or "'
_names = itertools.count()


def corpus_docs(n: int = 90) -> list[Document]:
    docs = []
    for i in range(n):
        r = doc_record(i)
        meta = {k: v for k, v in r.items() if k not in ("id", "text")}
        meta["rank"] = i
        if i % 10 == 0:
            meta["quote"] = 'say "hi" \\ bye'
        if i % 4 == 0:
            meta["maybe"] = None
        if i == 7:
            meta["section"] = INJECTION  # a literal value that looks like an expression
        docs.append(Document(r["id"], r["text"], meta))
    return docs


class Backend:
    """Creates, builds and reopens indexes of one backend kind under one temporary folder."""

    def __init__(self, kind: str, root: Path, db: Path | str) -> None:
        self.kind = "milvus" if kind.startswith("milvus") else kind
        self.root = root
        self.db = db
        self.location: str | Path = ""

    def _new_location(self) -> str | Path:
        n = next(_names)
        if self.kind == "faiss":
            return self.root / f"idx{n}"
        return f"milvus://{self.db}?collection=c{n}"

    def create(self, docs: list[Document], config: IndexConfig | None = None, space=None) -> IndexBackend:
        space = space or make_space()
        x = hash_embed([d.text for d in docs])
        self.location = self._new_location()
        if self.kind == "faiss":
            return create_index(self.location, docs, x, space, config)
        from qswap.index.backends.milvus.build import create_collection
        from qswap.index.backends.milvus.connection import parse_location
        uri, coll = parse_location(self.location)
        return create_collection(uri, coll, docs, x, space, config)

    def build(self, corpus: Path, on_bad_line: str = "stop") -> IndexBackend:
        self.location = self._new_location()
        if self.kind == "faiss":
            return build_index(corpus, self.location, hash_embed, make_space(), on_bad_line=on_bad_line,
                               progress=False)
        from qswap.index.backends.milvus.build import build_collection
        from qswap.index.backends.milvus.connection import parse_location
        uri, coll = parse_location(self.location)
        return build_collection(corpus, uri, coll, hash_embed, make_space(), on_bad_line=on_bad_line,
                                progress=False)

    def reopen(self, **kw) -> IndexBackend:
        return open_index(self.location, **kw)

    def exists(self) -> bool:
        if self.kind == "faiss":
            return Path(self.location).exists()
        from pymilvus import MilvusClient

        from qswap.index.backends.milvus.connection import parse_location
        uri, coll = parse_location(str(self.location))
        c = MilvusClient(uri)
        try:
            return c.has_collection(coll)
        finally:
            c.close()


@pytest.fixture(scope="module")
def milvus_db(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("milvus") / "conformance.db"


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path, milvus_db) -> Backend:
    if request.param == "milvus-server":
        srv = request.getfixturevalue("milvus_server")
        return Backend(request.param, tmp_path, f"127.0.0.1:{srv.port}")
    return Backend(request.param, tmp_path, milvus_db)


def reference(docs: list[Document], q: np.ndarray, k: int, pred=lambda d: True) -> list[list[str]]:
    keep = [d for d in docs if pred(d)]
    x = hash_embed([d.text for d in keep])
    out = []
    for row in q:
        s = x @ row
        order = sorted(range(len(keep)), key=lambda n: (-s[n], keep[n].id))[:k]
        out.append([keep[n].id for n in order])
    return out


QUERIES = hash_embed([f"document number {i} " + "word " * (i % 13) for i in (0, 5, 33)] + ["unrelated query"])


# mrl16: a 16-dimension prefix searched, candidates (all of them here) rescored with full vectors.
@pytest.mark.parametrize("config", [None, IndexConfig(dim=16, kind="flat", quant="sq8", oversample=18)],
                         ids=["default", "mrl16-sq8-rescored"])
def test_same_answers_as_brute_force(backend, config):
    docs = corpus_docs()
    with backend.create(docs, config) as idx:
        assert idx.count == len(docs)
        got = idx.search(QUERIES, 5)
        want = reference(docs, QUERIES, 5)
        assert [h.id for h in got[0]][0] == "d0" and [h.id for h in got[1]][0] == "d5"
        # exact (flat fp32) or rescored with full vectors: the top-5 agree with brute force
        for g, w in zip(got, want):
            assert [h.id for h in g] == w
        x = hash_embed([d.text for d in docs])
        by_id = {d.id: n for n, d in enumerate(docs)}
        for g, row in zip(got, QUERIES):
            for h in g:
                assert h.score == pytest.approx(float(x[by_id[h.id]] @ row), abs=2e-3)
        exact = idx.search_exact(QUERIES, 5, with_text=True)
        assert [[h.id for h in e] for e in exact] == want
        assert exact[0][0].text == docs[0].text and exact[0][0].metadata == docs[0].metadata
        no_text = idx.search(QUERIES[:1], 2, with_text=False)[0]
        assert no_text[0].text is None and no_text[0].metadata["rank"] == 0


FILTERS = [
    ({"section": "games"}, lambda m: m.get("section") == "games"),
    ({"year": 2001, "hot": False}, lambda m: m.get("year") == 2001 and m.get("hot") is False),
    ({"year": 2003.0}, lambda m: m.get("year") == 2003),
    ({"hot": True}, lambda m: m.get("hot") is True),
    ({"hot": 1}, lambda m: False),             # strict types: 1 is not true
    ({"rank": True}, lambda m: False),         # ... and true is not 1
    ({"year": "2001"}, lambda m: False),       # a string is not a number
    ({"quote": 'say "hi" \\ bye'}, lambda m: m.get("quote") == 'say "hi" \\ bye'),
    ({"section": INJECTION}, lambda m: m.get("section") == INJECTION),  # the literal, only
    ({"section": 'x" or id > "" or "'}, lambda m: False),
    ({"section": "games\" || meta[\"hot\"] == true || \"\\"}, lambda m: False),
    ({"missing": "x"}, lambda m: False),
    ({"maybe": None}, lambda m: "maybe" in m and m["maybe"] is None),
    ({"missing": None}, lambda m: False),
]


def test_metadata_filters_match_the_reference(backend):
    docs = corpus_docs()
    with backend.create(docs) as idx:
        for flt, pred in FILTERS:
            got = [[h.id for h in r] for r in idx.search(QUERIES, 7, filter=flt)]
            want = reference(docs, QUERIES, 7, lambda d: pred(d.metadata))
            assert got == want, flt
            assert [[h.id for h in r] for r in idx.search_exact(QUERIES, 7, filter=flt)] == want, flt


def test_approximate_index_types_map_and_find_neighbours(backend):
    docs = corpus_docs()
    cfg = IndexConfig(dim=16, kind="ivf", quant="sq8", nlist=4, nprobe=4)
    with backend.create(docs, cfg) as idx:
        info = idx.info()
        assert info["dim"] == 16 and info["config"]["kind"] == "ivf" and info["rescoring"]
        if backend.kind == "milvus":
            assert info["milvus"]["index_type"] == "IVF_SQ8" and info["milvus"]["full_vectors"]
        q = hash_embed([d.text for d in docs[:20]])
        top1 = [r[0].id for r in idx.search(q, 1)]
        assert sum(a == d.id for a, d in zip(top1, docs)) >= 18


def test_expression_injection_matches_nothing(backend):
    docs = [Document(f"d{i}", f"text {i}", {"section": "games"}) for i in range(20)]
    with backend.create(docs) as idx:
        assert idx.search(QUERIES, 10, filter={"section": INJECTION}) == [[]] * len(QUERIES)
        with pytest.raises(InvalidInputError):  # field names with quotes are refused outright
            idx.search(QUERIES, 10, filter={INJECTION: "games"})
        assert idx.delete([INJECTION, 'd1" or id != "']) == 0
        assert idx.count == 20
        assert idx.get(['d1" or id != "']) == [None]


def test_hostile_literals_round_trip_as_values_and_ids(backend):
    """Every hostile string of the expression builder's tests, stored as an id and as a metadata
    value, is found by exactly that filter and that id, and by nothing else, on the real engine."""
    hostile = INJECTIONS
    docs = [Document(f"h{n}" if n % 2 else v, f"hostile text {n}", {"v": v}) for n, v in enumerate(hostile)]
    docs += [Document(f"plain{i}", f"plain text {i}", {"v": "plain"}) for i in range(5)]
    with backend.create(docs) as idx:
        for d in docs[:len(hostile)]:
            hits = idx.search(QUERIES[:1], 20, filter={"v": d.metadata["v"]})[0]
            assert [h.id for h in hits] == [d.id], d.metadata["v"]
            assert idx.get([d.id]) == [d]
        assert idx.delete([v for n, v in enumerate(hostile) if n % 2]) == 0   # values, not ids: nothing
        assert idx.count == len(docs)


BAD_FILTERS = {"surrogate-key": {"\udc00": "x"}, "surrogate-value": {"section": "\udc00"}, "above-2^63": {"n": 2 ** 63},
               "1000-keys": {f"f{i}": i for i in range(1000)}}


def test_bad_filters_are_invalid_input(backend):
    with backend.create(corpus_docs(12)) as idx:   # one index for every filter: a server build is seconds
        for name, flt in BAD_FILTERS.items():
            with pytest.raises(InvalidInputError):
                idx.search(QUERIES, 3, filter=flt)
                pytest.fail(name)


def test_add_delete_upsert(backend):
    docs = corpus_docs(30)
    with backend.create(docs) as idx:
        new = [Document("n1", "brand new one", {"section": "new"}), Document("n2", "brand new two", {})]
        assert idx.add(new, hash_embed([d.text for d in new])) == 2
        assert idx.count == 32
        with pytest.raises(ConflictError):
            idx.add([docs[0]], hash_embed([docs[0].text]))
        assert idx.count == 32
        assert idx.search(hash_embed(["brand new one"]), 1)[0][0].id == "n1"
        up = [Document("d3", "rewritten three", {"section": "up"}), Document("n3", "third new", {})]
        assert idx.upsert(up, hash_embed([d.text for d in up])) == 2
        assert idx.count == 33
        assert idx.get(["d3"])[0] == up[0]
        assert idx.search(hash_embed(["rewritten three"]), 1)[0][0].id == "d3"
        assert [h.id for h in idx.search(hash_embed(["rewritten three"]), 3, filter={"section": "up"})[0]] == ["d3"]
        assert idx.search(hash_embed([docs[3].text]), 1)[0][0].id != "d3"  # the old vector is gone
        assert idx.delete(["d4", "d5", "absent"]) == 2
        assert idx.count == 31
        assert idx.get(["d4", "d6"])[0] is None and idx.get(["d6"])[0] == docs[6]
        assert all(h.id not in ("d4", "d5") for h in idx.search(hash_embed([docs[4].text]), 31)[0])
        got = idx.get_embeddings(["d6", "n1"])
        np.testing.assert_allclose(got, hash_embed([docs[6].text, "brand new one"]), atol=2e-3)
        with pytest.raises(NotFoundError):
            idx.get_embeddings(["d4"])
        with pytest.raises(InvalidInputError):
            idx.delete(["\udc00"])
        with pytest.raises(InvalidInputError):
            idx.upsert([Document("x", "t", {"m": "\udc00"})], hash_embed(["t"]))
        assert idx.count == 31


def test_reopen_read_only_and_space_mismatch(backend):
    docs = corpus_docs(25)
    backend.create(docs).close()
    with backend.reopen(read_only=True, expected_space=make_space()) as idx:
        assert isinstance(idx, IndexBackend) and idx.info()["backend"] == backend.kind
        assert idx.count == 25 and idx.space == make_space()
        assert idx.search(hash_embed([docs[9].text]), 1)[0][0].id == "d9"
        with pytest.raises(InvalidInputError, match="read-only"):
            idx.delete(["d1"])
        ids, vecs = idx.export_embeddings()
        assert sorted(ids) == sorted(d.id for d in docs) and vecs.shape == (25, 32)
    with pytest.raises(SpaceMismatchError):
        backend.reopen(expected_space=make_space(weights="c"))
    with backend.reopen() as idx:
        assert idx.delete(["d1"]) == 1
    with backend.reopen() as idx:
        assert idx.count == 24 and idx.get(["d1"]) == [None]


def test_bad_corpus_lines(backend, tmp_path):
    rows = [doc_record(i) for i in range(20)]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:5] + [b"{not json\n", {"id": "x"}] + rows[5:])
    with pytest.raises(InvalidInputError, match="line 6"):
        backend.build(bad)
    assert not backend.exists()  # a refused corpus creates nothing
    with backend.build(bad, on_bad_line="skip") as idx:
        assert idx.count == 20
        info = idx.info()
        assert info["build"]["n_bad_lines"] == 2 and info["documents"] == 20
        assert idx.search(hash_embed([rows[12]["text"]]), 1)[0][0].id == "d12"


def test_every_backend_has_the_whole_interface(backend):
    """Callers never probe: each member the protocol names answers on both backends, and the
    manifest, config and space agree with what was built."""
    members = [n for n, v in vars(IndexBackend).items()
               if (not n.startswith("_") or n in ("__enter__", "__exit__")) and (callable(v) or isinstance(v, property))]
    assert {"manifest", "config", "dim", "space", "search", "close"} <= set(members)
    with backend.create(corpus_docs(20), IndexConfig(dim=16, kind="flat", quant="sq8")) as idx:
        assert all(hasattr(idx, n) for n in members), [n for n in members if not hasattr(idx, n)]
        assert idx.manifest["space"] == idx.space.to_dict()
        assert idx.config.dim == idx.dim == 16 and idx.full_dim == idx.space.dim
