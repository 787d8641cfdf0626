from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.index import Document, DocumentIndex, IndexConfig, create_index
from qswap.index.backends.faiss import commit as store_mod

KINDS = [IndexConfig(kind="flat", quant="sq8", dim=16), IndexConfig(kind="hnsw", quant="fp16"),
         IndexConfig(kind="ivf", quant="sq8", nprobe=64)]
KIND_IDS = ["flat", "hnsw", "ivf"]


def docs_for(n, start=0, prefix="d"):
    return [Document(f"{prefix}{i}", f"text {i}", {"section": ("games", "news", "tech")[i % 3], "year": 2000 + i % 5,
                                                    "hot": i % 2 == 0, "rank": i})
            for i in range(start, start + n)]


@pytest.fixture
def make(tmp_path, space, embed):
    def _make(config=None, n=120):
        docs = docs_for(n)
        return create_index(tmp_path / "idx", docs, embed([d.text for d in docs]), space, config)
    return _make


def all_ids(idx):
    return {h.id for h in idx.search(np.ones((1, idx.full_dim), np.float32), idx.count + 50, with_text=False)[0]}


@pytest.mark.parametrize("config", KINDS, ids=KIND_IDS)
def test_add_delete_upsert_consistency_and_persistence(make, embed, config, tmp_path):
    idx = make(config)
    new = docs_for(10, start=500)
    assert idx.add(new, embed([d.text for d in new])) == 10
    assert idx.count == 130
    assert idx.search(embed(["text 503"]), 1)[0][0].id == "d503"

    gen = idx.generation
    with pytest.raises(ConflictError, match="already in the index"):
        idx.add(docs_for(2, start=0), embed(["a", "b"]))
    assert idx.generation == gen and idx.count == 130

    assert idx.delete(["d1", "d2", "d3", "nope", "d1"]) == 3
    assert idx.delete(["d1"]) == 0
    ids = all_ids(idx)
    assert len(ids) == 127 and not ids & {"d1", "d2", "d3"}
    for q in ("text 1", "text 2", "text 3"):
        assert all(h.id not in {"d1", "d2", "d3"} for h in idx.search(embed([q]), 10)[0])

    up = [Document("d10", "rewritten", {"section": "new"}), Document("x1", "brand new", {})]
    assert idx.upsert(up, embed(["rewritten", "brand new"])) == 2
    assert idx.count == 128
    top = idx.search(embed(["rewritten"]), 1)[0][0]
    assert (top.id, top.text, top.metadata) == ("d10", "rewritten", {"section": "new"})
    assert all(h.id != "d10" or h.score < 0.9 for h in idx.search(embed(["text 10"]), 5)[0])
    np.testing.assert_allclose(idx.get_embeddings(["d10"])[0], embed(["rewritten"])[0], atol=1e-3)
    state = (all_ids(idx), idx.count, idx.generation)
    idx.close()

    with DocumentIndex.open(tmp_path / "idx") as again:
        assert (all_ids(again), again.count, again.generation) == state
        assert again.get(["d10", "d1"])[0].text == "rewritten" and again.get(["d1"])[0] is None
        assert again.search(embed(["text 503"]), 1)[0][0].id == "d503"
        if config.kind == "hnsw":
            assert again.info()["tombstones"] == 4  # d1 d2 d3 and the old d10


def test_snapshots_and_hnsw_tombstone_rebuild(make, embed, tmp_path, monkeypatch):
    monkeypatch.setattr(DocumentIndex, "SNAPSHOT_MIN_CHANGES", 5)
    monkeypatch.setattr(DocumentIndex, "SNAPSHOT_FRACTION", 0.0)
    monkeypatch.setattr(DocumentIndex, "TOMBSTONE_MIN", 6)
    monkeypatch.setattr(DocumentIndex, "TOMBSTONE_FRACTION", 0.0)
    idx = make(IndexConfig(kind="hnsw"))
    first = idx.manifest["faiss"]["file"]
    idx.delete(["d0", "d1"])
    assert idx.manifest["faiss"]["file"] == first and idx.info()["changes_since_snapshot"] == 2
    idx.delete(["d2", "d3", "d4"])
    snap = idx.manifest["faiss"]["file"]
    assert snap != first and not (tmp_path / "idx" / first).exists()
    assert idx.info()["tombstones"] == 5 and idx.info()["changes_since_snapshot"] == 0
    idx.delete(["d5", "d6"])  # 7 tombstones > 6: HNSW rebuilt without them
    info = idx.info()
    assert info["tombstones"] == 0 and info["faiss_vectors"] == idx.count == 113
    assert not all_ids(idx) & {f"d{i}" for i in range(7)}
    idx.close()


def test_save_writes_snapshot_so_open_replays_nothing(make, embed, tmp_path):
    idx = make(IndexConfig(kind="hnsw"))
    idx.add(docs_for(3, start=900), embed(["a", "b", "c"]))
    idx.delete(["d0"])
    assert idx.info()["changes_since_snapshot"] == 4
    idx.save()
    info = idx.info()
    assert info["changes_since_snapshot"] == 0 and info["tombstones"] == 0
    gen = idx.generation
    idx.save()  # nothing to do
    assert idx.generation == gen
    idx.close()
    with DocumentIndex.open(tmp_path / "idx") as again:
        assert again.info()["faiss_vectors"] == again.count == 122


def test_many_small_adds_keep_few_chunk_files(make, embed, tmp_path):
    idx = make(IndexConfig(kind="flat"), n=40)
    for i in range(40):
        d = Document(f"n{i}", f"new {i}", {})
        idx.add([d], embed([d.text]))
    chunks = sorted((tmp_path / "idx" / "emb").glob("*.f16"))
    assert len(chunks) == len(idx.manifest["embeddings"]["chunks"]) <= 8
    np.testing.assert_allclose(idx.get_embeddings([f"n{i}" for i in range(40)]),
                               embed([f"new {i}" for i in range(40)]), atol=1e-3)
    idx.close()
    with DocumentIndex.open(tmp_path / "idx") as again:
        assert again.count == 80


FILTER_CASES = [({"section": "games"}, lambda d: d.metadata["section"] == "games"),
                ({"year": 2001}, lambda d: d.metadata["year"] == 2001),
                ({"year": 2001.0, "hot": False}, lambda d: d.metadata["year"] == 2001 and not d.metadata["hot"]),
                ({"hot": True}, lambda d: d.metadata["hot"] is True),
                ({"rank": 7}, lambda d: d.metadata["rank"] == 7),
                ({"section": "nothing"}, lambda d: False)]


@pytest.mark.parametrize("exact_max", [20_000, 0], ids=["exact-path", "ann-path"])
@pytest.mark.parametrize("config", KINDS + [IndexConfig(kind="flat", quant="pq")], ids=KIND_IDS + ["flat-pq"])
def test_filters_return_k_matching_documents(make, embed, config, exact_max, monkeypatch):
    monkeypatch.setattr(DocumentIndex, "EXACT_FILTER_MAX", exact_max)
    idx = make(config)
    idx.delete(["d0", "d3"])  # deleted documents never come back, filtered or not
    docs = [d for d in docs_for(120) if d.id not in ("d0", "d3")]
    q = embed(["text 4", "text 60", "query"])
    for flt, pred in FILTER_CASES:
        matching = {d.id for d in docs if pred(d)}
        res = idx.search(q, 10, filter=flt)
        exact = idx.search_exact(q, 10, filter=flt)
        for hits, ex in zip(res, exact):
            assert len(hits) == min(10, len(matching)), flt
            assert {h.id for h in hits} <= matching
            if exact_max or config.quant == "pq":  # selective filters (and flat PQ) are scored exactly
                assert [h.id for h in hits] == [h.id for h in ex]
    assert idx.search(q, 10, filter={"hot": 1})[0] == []  # booleans match booleans only
    assert idx.search(q, 10, filter={"section": 1})[0] == []
    idx.close()


def test_bad_filters_and_queries(make):
    idx = make()
    q = np.ones((1, 32), np.float32)
    for flt in ({"section": ["games"]}, {'se"ction': "x"}, {"": "x"}, {"x": float("nan")}):
        with pytest.raises(InvalidInputError):
            idx.search(q, 3, filter=flt)
    with pytest.raises(InvalidInputError, match="shape"):
        idx.search(np.ones((2, 31), np.float32), 3)
    with pytest.raises(InvalidInputError, match="positive"):
        idx.search(q, 0)
    with pytest.raises(InvalidInputError, match="all zeros"):
        idx.search(np.zeros((1, 32), np.float32), 3)
    assert len(idx.search(q[0], 3)) == 1  # one row as a vector
    assert idx.search(np.zeros((0, 32), np.float32), 3) == []
    assert len(idx.search(q, 1000)[0]) == 120
    assert idx.search(q, 2, with_text=False)[0][0].text is None
    with pytest.raises(InvalidInputError):
        idx.add([Document("z", "t", {"bad": object()})], q)
    with pytest.raises(InvalidInputError, match="duplicate id"):
        idx.add([Document("z", "t"), Document("z", "u")], np.ones((2, 32)))
    with pytest.raises(InvalidInputError, match="2 documents but 1 embeddings"):
        idx.add([Document("z", "t"), Document("y", "u")], q)
    with pytest.raises(NotFoundError):
        idx.get_embeddings(["nope"])
    idx.close()


def test_writer_lock_and_read_only(make, embed, tmp_path):
    idx = make()
    with pytest.raises(ConflictError, match="open for writing"):
        DocumentIndex.open(tmp_path / "idx")
    with DocumentIndex.open(tmp_path / "idx", read_only=True) as ro:
        assert ro.count == 120
        with pytest.raises(InvalidInputError, match="read-only"):
            ro.delete(["d1"])
    idx.delete(["d1"])
    idx.close()
    with DocumentIndex.open(tmp_path / "idx", read_only=True) as ro:
        assert ro.count == 119


def test_reindex_reuses_stored_embeddings(make, embed, tmp_path):
    idx = make(IndexConfig(kind="flat", quant="fp32"))
    emb_files = dict(idx.manifest["embeddings"]["chunks"][0])
    idx.reindex(IndexConfig(kind="ivf", quant="sq4", dim=8))
    assert (idx.dim, idx.config.kind, idx.config.quant) == (8, "ivf", "sq4")
    assert idx.manifest["embeddings"]["chunks"][0] == emb_files
    assert idx.search(embed(["text 5"]), 1)[0][0].id == "d5"
    faiss_file = idx.manifest["faiss"]["file"]
    idx.reindex(IndexConfig(nprobe=3, oversample=2))  # search-time only: FAISS untouched
    assert idx.manifest["faiss"]["file"] == faiss_file and idx.config.nprobe == 3 and idx.config.kind == "ivf"
    idx.close()
    with DocumentIndex.open(tmp_path / "idx") as again:
        assert again.dim == 8 and again.config.nprobe == 3


def test_with_config_variant_writes_nothing(make, embed, tmp_path):
    idx = make()
    before = sorted(p.name for p in (tmp_path / "idx").rglob("*"))
    v = idx.with_config(IndexConfig(kind="hnsw", quant="sq8", dim=16))
    assert v.config.kind == "hnsw" and v.dim == 16 and v.count == 120
    assert v.search(embed(["text 9"]), 1)[0][0].id == "d9"
    with pytest.raises(InvalidInputError, match="in-memory"):
        v.delete(["d1"])
    v.close()
    assert idx.search(embed(["text 9"]), 1)[0][0].id == "d9"  # closing the variant keeps the index usable
    assert sorted(p.name for p in (tmp_path / "idx").rglob("*")) == before
    vv = idx.with_config(IndexConfig(kind="flat", quant="sq8")).with_config(IndexConfig(rescore=False))
    assert vv.config.quant == "sq8" and not vv.config.rescore and len(vv.search(embed(["x"]), 3)[0]) == 3
    idx.close()
    with pytest.raises(InvalidInputError, match="closed"):
        vv.search(embed(["x"]), 3)


def test_failed_commit_leaves_previous_state(make, embed, tmp_path, monkeypatch):
    idx = make(IndexConfig(kind="hnsw"))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store_mod, "write_manifest", boom)
    d = Document("new", "fresh", {})
    with pytest.raises(OSError):
        idx.add([d], embed(["fresh"]))
    with pytest.raises(OSError):
        idx.delete(["d1"])
    assert idx.count == 120 and "new" not in all_ids(idx) and "d1" in all_ids(idx)
    assert len(list((tmp_path / "idx" / "emb").glob("*.f16"))) == 1
    monkeypatch.undo()
    idx.add([d], embed(["fresh"]))
    assert idx.search(embed(["fresh"]), 1)[0][0].id == "new"
    idx.close()
    with DocumentIndex.open(tmp_path / "idx") as again:
        assert again.count == 121


def test_concurrent_searches_during_changes(make, embed):
    idx = make(IndexConfig(kind="hnsw"), n=200)
    deleted: set[str] = set()
    guard = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()
    q = embed([f"text {i}" for i in range(16)])

    def searcher():
        try:
            while not stop.is_set():
                with guard:
                    gone = set(deleted)
                for hits in idx.search(q, 10):
                    assert len(hits) == 10
                    bad = {h.id for h in hits} & gone
                    assert not bad, f"deleted ids returned: {bad}"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=searcher) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(0, 60, 3):
            ids = [f"d{i}", f"d{i + 1}", f"d{i + 2}"]
            idx.delete(ids)
            with guard:
                deleted.update(ids)
            new = docs_for(2, start=1000 + i)
            idx.upsert(new, embed([d.text for d in new]))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert idx.count == 200 - 60 + 40
    idx.close()


@pytest.mark.parametrize("config", [IndexConfig(kind="hnsw", quant="sq8"), IndexConfig(kind="ivf", quant="sq8"),
                                    IndexConfig(kind="flat", quant="pq")], ids=["hnsw", "ivf", "flat-pq"])
def test_delete_everything_then_add_again(make, embed, config, monkeypatch, tmp_path):
    monkeypatch.setattr(DocumentIndex, "TOMBSTONE_MIN", 10)
    monkeypatch.setattr(DocumentIndex, "TOMBSTONE_FRACTION", 0.0)
    idx = make(config, n=40)
    assert idx.delete([f"d{i}" for i in range(40)]) == 40
    assert idx.count == 0 and idx.search(embed(["text 1"]), 5) == [[]]
    assert idx.search(embed(["text 1"]), 5, filter={"section": "games"}) == [[]]
    idx.save()
    new = docs_for(5, start=100)
    idx.add(new, embed([d.text for d in new]))
    assert [h.id for h in idx.search(embed(["text 102"]), 1)[0]] == ["d102"]
    idx.reindex(IndexConfig(dim=16))  # retrains on every stored row, retired ones included
    assert idx.search(embed(["text 102"]), 1)[0][0].id == "d102"
    idx.close()
    with DocumentIndex.open(tmp_path / "idx") as again:
        assert again.count == 5


@pytest.mark.parametrize("config", [IndexConfig(kind="flat"), IndexConfig(kind="hnsw")], ids=["flat", "hnsw"])
def test_a_search_is_answered_while_a_change_writes_its_generation(make, embed, config, monkeypatch):
    """A commit writes its files, rows and manifest while searches go on over the open generation
    (which shows none of it until the swap); a second change waits for the first."""
    idx = make(config, n=120)
    inside, release, searched = threading.Event(), threading.Event(), threading.Event()
    reached: list[tuple[str, bool]] = []   # (change, whether the first had been let go) at its manifest
    real = store_mod.write_manifest

    def held(path, m):
        name = threading.current_thread().name
        reached.append((name, release.is_set()))
        if name == "first":
            inside.set()
            assert release.wait(60)
        real(path, m)

    monkeypatch.setattr(store_mod, "write_manifest", held)
    new = docs_for(3, start=900, prefix="n")
    first = threading.Thread(target=idx.upsert, args=(new, embed([d.text for d in new])), name="first")
    second = threading.Thread(target=idx.delete, args=(["d5"],), name="second")
    seen: list = []

    def search():
        seen.append(([h.id for h in idx.search(embed(["text 900"]), 5)[0]], idx.count, idx.get(["n900", "d5"])))
        searched.set()

    first.start()
    try:
        assert inside.wait(60)                     # the first change has written all but its manifest
        second.start()
        threading.Thread(target=search, daemon=True).start()
        assert searched.wait(30), "the search waited for the change"
    finally:
        release.set()
        first.join(60)
        second.join(60)
    ids, count, got = seen[0]
    assert "n900" not in ids and count == 120 and got[0] is None and got[1].id == "d5"   # the open generation
    assert reached == [("first", False), ("second", True)]   # the second change waited for the first
    assert idx.count == 122 and idx.get(["n900", "d5"])[1] is None
    assert idx.search(embed(["text 900"]), 1)[0][0].id == "n900"
    idx.close()


def test_searches_continue_while_reindexing(make, embed):
    idx = make(IndexConfig(kind="flat"), n=1000)
    done = threading.Event()
    first = threading.Event()
    counts = []

    stamps = []

    def searcher():
        while not done.is_set():
            counts.append(len(idx.search(embed(["text 7"]), 3)[0]))
            stamps.append(time.perf_counter())
            first.set()

    t = threading.Thread(target=searcher)
    t.start()
    try:
        assert first.wait(60)                         # searches are running before the reindex starts
        t0 = time.perf_counter()
        idx.reindex(IndexConfig(kind="hnsw", quant="sq8", ef_construction=400, hnsw_m=64))
        t1 = time.perf_counter()
    finally:
        done.set()
        t.join()
    assert counts and set(counts) == {3}
    assert sum(t0 < s < t1 for s in stamps) >= 3  # the build did not block searches
    assert idx.config.kind == "hnsw" and idx.search(embed(["text 7"]), 1)[0][0].id == "d7"
    idx.close()


def test_forgotten_close_releases_the_writer_lock(make, tmp_path):
    import gc
    idx = make()
    del idx
    gc.collect()
    with DocumentIndex.open(tmp_path / "idx") as again:
        assert again.count == 120
