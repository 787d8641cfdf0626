"""Exact answers of the test servers: a hit's score is the cosine under the encoder that served it."""

from __future__ import annotations

import numpy as np

TOL = 3e-3   # the index rescoring uses float16 document vectors


def exact_scores(pool, doc_emb: np.ndarray, ids: list[str], key: str, query: str) -> dict[str, float]:
    q = pool.encode([query], [key])[0]
    return dict(zip(ids, (doc_emb @ q).tolist()))


def assert_served_by(hits: list[dict], pool, doc_emb, ids, key: str, query: str, k: int) -> None:
    """Every hit's score is the exact cosine under encoder ``key``, and the hits are a top-k."""
    exact = exact_scores(pool, doc_emb, ids, key, query)
    kth = sorted(exact.values(), reverse=True)[k - 1]
    assert len(hits) == k
    for h in hits:
        assert abs(h["score"] - exact[h["id"]]) < TOL, (key, h)
        assert exact[h["id"]] >= kth - TOL
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)

