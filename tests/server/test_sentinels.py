"""server/sentinels.py: the guard's sentinel encoding."""

from __future__ import annotations

import numpy as np


def test_guard_encodes_sentinels_length_sorted_but_keeps_query_order():
    from qswap.guard.evaluator import GuardEvaluator
    from qswap.guard.sentinels import IndexSentinel
    texts = [("q" * n) + f" {i}" for i, n in enumerate([3, 40, 1, 17, 25, 2, 33] * 10)]
    calls: list[list[str]] = []

    def encode(chunk: list[str], keys: list[str]) -> np.ndarray:
        calls.append(chunk)
        return np.array([[len(t), float(t.split()[-1])] for t in chunk], dtype=np.float32)

    s = IndexSentinel("s", None, [str(i) for i in range(len(texts))], texts, [{"d": 1}] * len(texts))
    guard = GuardEvaluator([s], index=None, encode=encode)
    try:
        emb = guard._embeddings("k", "v1", lambda n: None)[0]
    finally:
        guard.close()
    assert emb[:, 1].tolist() == list(range(len(texts)))          # row i is query i
    assert [len(c) for c in calls] == [32, 32, 6]
    lens = [len(t) for c in calls for t in c]
    assert lens == sorted(lens, reverse=True)                      # chunks of similar length
