"""A search's index side: one query answers exactly as it does within a batch (the one-query
shortcuts of rescoring and fetching), stored metadata reads back as written, and the
embedding log gathers the same rows from one chunk as from many."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qswap.index import Document, IndexConfig, create_index
from qswap.index.backends.faiss.docstore import meta_json, meta_of

CONFIGS = [IndexConfig(kind="hnsw", quant="sq8"), IndexConfig(kind="flat", quant="sq8", dim=16),
           IndexConfig(kind="flat", quant="fp32")]


def _docs(n: int) -> list[Document]:
    return [Document(f"d{i}", f"text {i}", {"rank": i, "w": i / 7, "tag": "é\n\"x\""}) for i in range(n)]


@pytest.mark.parametrize("config", CONFIGS, ids=["hnsw-sq8-rescored", "flat-sq8-matryoshka", "flat-exact"])
def test_one_query_answers_as_within_a_batch(tmp_path, space, embed, config):
    docs = _docs(300)
    idx = create_index(tmp_path / "idx", docs, embed([d.text for d in docs]), space, config)
    try:
        q = embed([f"query {i}" for i in range(12)])
        batch = idx.search(q, 10)
        for i in range(len(q)):
            alone = idx.search(q[i:i + 1], 10)[0]
            assert [h.id for h in alone] == [h.id for h in batch[i]]
            assert [h.score for h in alone] == [h.score for h in batch[i]]   # the same floats, not close ones
            assert [(h.text, h.metadata) for h in alone] == [(h.text, h.metadata) for h in batch[i]]
        hit = batch[0][0]
        assert hit.metadata == docs[int(hit.id[1:])].metadata and hit.text == docs[int(hit.id[1:])].text
    finally:
        idx.close()


@pytest.mark.parametrize("meta", [{}, {"a": 1, "b": [1.5, None, True], "c": {"d": "é\u2028\x01"}},
                                  {"big": 2 ** 70, "neg": -(2 ** 64)}, {"f": 1e-7, "g": 1e16, "h": -0.0, "i": 0.1},
                                  {"deep": [[[[{"x": [1, 2.5e-300]}]]]]}])
def test_stored_metadata_reads_back_as_json_reads_it(meta):
    stored = meta_json(meta)
    got = meta_of(stored)
    assert got == json.loads(stored) == meta
    assert json.dumps(got) == json.dumps(json.loads(stored))   # same types (int stays int, float float)


def test_random_floats_read_back_exactly():
    rng = np.random.default_rng(0)
    values = [float(x) for x in rng.standard_normal(2000) * 10.0 ** rng.integers(-300, 300, 2000)]
    assert meta_of(meta_json({"v": values}))["v"] == values


def test_gather_is_the_same_from_one_chunk_and_from_many(tmp_path, space, embed):
    docs = _docs(23)
    idx = create_index(tmp_path / "idx", docs[:20], embed([d.text for d in docs[:20]]), space)
    try:
        one = idx._store.gather(np.array([3, 0, 19, 3]))
        assert len(idx._store.chunks) == 1
        for d in docs[20:]:   # one at a time: small chunks of their own
            idx.add([d], embed([d.text]))
        assert len(idx._store.chunks) > 1
        rows = np.array([3, 0, 19, 3, 21, 22, 20])
        many = idx._store.gather(rows)
        assert np.array_equal(many[:4], one)
        x = idx._store.gather16(rows).astype(np.float32)
        assert np.array_equal(many, x / np.linalg.norm(x, axis=1, keepdims=True))
    finally:
        idx.close()
