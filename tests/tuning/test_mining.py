"""Hard-negative mining with the false-negative cutoff, and the document cache."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from qswap.errors import IntegrityError, SpaceMismatchError
from qswap.tuning.data import Sample
from qswap.tuning.doc_cache import DocTable, embed_documents
from qswap.tuning.mining import MiningStats, keep_negatives, mine_negatives


def test_keep_negatives_drops_positives_and_probable_false_negatives():
    stats = MiningStats()
    rows = [10, 11, 12, 13, 14]
    scores = [0.99, 0.90, 0.80, 0.85, 0.50]     # positive (row 10) scores 0.90... and row 10 is it
    kept = keep_negatives(rows, scores, {10}, positive_score=0.90, cutoff=0.95, n=2, stats=stats)
    # 0.90 > 0.95 * 0.90 = 0.855 -> dropped; 0.85 kept, then 0.80
    assert kept == [13, 12]
    assert stats.dropped_positive == 1 and stats.dropped_false_negative == 1
    assert keep_negatives(rows, scores, {10}, 0.90, None, 2) == [11, 13]


def test_mining_from_the_corpus(tiny_base, tmp_path):
    table = DocTable()
    docs = ["chess puzzle game", "chess puzzle games", "linux server tool", "music audio sound",
            "physics chemistry science"]
    for i, t in enumerate(docs):
        table.add(t, f"d{i}")
    table.embed(tiny_base, tmp_path, progress=False)
    samples = [Sample("chess puzzle", [docs[0]], positive_ids=["d0"], negative_ids=[]),
               Sample("linux tool", [docs[2]], positive_ids=["d2"], negative_ids=[])]
    stats = mine_negatives(samples, tiny_base, table, k=5, n_negatives=2, cutoff=None, by_id=True,
                           cache_dir=tmp_path, progress=False)
    assert stats.mined == 4 and stats.dropped_positive == 2
    for s in samples:
        assert len(s.negatives) == 2 and s.positive_ids[0] not in s.negative_ids
        # the mined negatives are the highest-scoring non-positives by the base encoder
        q = tiny_base.encode_queries([s.query])[0]
        emb = table.emb / np.linalg.norm(table.emb, axis=1, keepdims=True)
        order = [table.keys[r] for r in np.argsort(-(emb @ (q / np.linalg.norm(q))))
                 if table.keys[r] not in s.positive_ids]
        assert s.negative_ids == order[:2]


def test_mining_from_an_index_checks_its_space(tiny_base, other_tiny_model_dir, tmp_path):
    from qswap.encoders import load_base
    other = load_base(other_tiny_model_dir, device="cpu")
    hit = SimpleNamespace(id="x1", score=0.5, text="music audio sound", metadata={})
    index = SimpleNamespace(space=other.space, search=lambda q, k: [[hit]] * len(q))
    table = DocTable()
    table.add("chess puzzle game")
    with pytest.raises(SpaceMismatchError):
        mine_negatives([Sample("chess", ["chess puzzle game"])], tiny_base, table, index=index, k=1,
                       cutoff=None, cache_dir=tmp_path, progress=False)
    index.space = tiny_base.space
    s = Sample("chess", ["chess puzzle game"])
    mine_negatives([s], tiny_base, table, index=index, k=1, cutoff=None, cache_dir=tmp_path, progress=False)
    assert s.negatives == ["music audio sound"]


def test_document_cache_is_used_and_checked(tiny_base, tmp_path):
    texts = ["chess puzzle game", "linux server tool"]
    a = embed_documents(tiny_base, texts, tmp_path, progress=False)
    files = sorted(p.name for p in (tmp_path / tiny_base.space.fingerprint).iterdir())
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".npy")
    b = embed_documents(tiny_base, texts, tmp_path, progress=False)
    assert np.array_equal(a, b)                        # first and cached runs are identical
    assert np.abs(a - tiny_base.encode_documents(texts)).max() < 1e-2    # fp16 storage
    npy = next((tmp_path / tiny_base.space.fingerprint).glob("*.npy"))
    np.save(npy, np.zeros((3, tiny_base.dim), dtype=np.float16))
    with pytest.raises(IntegrityError):
        embed_documents(tiny_base, texts, tmp_path, progress=False)
