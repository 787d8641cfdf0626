"""PND, MRR, MAP, P@1, nDCG@10 and recall on rankings small enough to check by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qswap.guard.evaluation import compare_metrics, evaluate_candidates, evaluate_retrieval

# Query along x; documents at known cosines to it: 1.0, 0.8, 0.6, 0.0 (and a tie at 0.8).
Q = np.array([[1.0, 0.0]], dtype=np.float32)


def _doc(cos: float) -> list[float]:
    return [cos, math.sqrt(1 - cos * cos)]


DOCS = np.array([_doc(1.0), _doc(0.8), _doc(0.6), _doc(0.0), _doc(0.8)], dtype=np.float32)


def test_pnd_counts_pairs_where_the_positive_is_not_closer():
    # positive at 0.6; negatives at 1.0, 0.8, 0.0 -> 2 of 3 pairs are errors
    m = evaluate_candidates(Q, DOCS, [[2]], [[0, 1, 3]])
    assert (m.errors_cos, m.pairs) == (2, 3)
    assert m.pnd_cos == pytest.approx(2 / 3)
    assert m.errors_dist == 2           # unit vectors: distance orders like cosine


def test_a_tie_is_an_error():
    m = evaluate_candidates(Q, DOCS, [[1]], [[4]])      # both at 0.8
    assert m.errors_cos == 1 and m.errors_dist == 1


def test_pnd_averages_per_query():
    q = np.repeat(Q, 2, axis=0)
    m = evaluate_candidates(q, DOCS, [[0], [2]], [[1, 3], [0, 1, 3]])   # 0/2 and 2/3
    assert m.pnd_cos == pytest.approx((0 + 2 / 3) / 2)
    assert (m.errors_cos, m.pairs) == (2, 5)


def test_rank_metrics_by_hand():
    # ranking: d0 (1.0), d1 (0.8), d4 (0.8, later index), d2 (0.6), d3 (0.0); relevant d1, d2
    m = evaluate_retrieval(Q, DOCS, [{1: 1, 2: 1}], ks=(1, 2, 5))
    assert m.mrr == pytest.approx(1 / 2)
    assert m.map == pytest.approx((1 / 2 + 2 / 4) / 2)
    assert m.p_at_1 == 0.0 and m.hits_at_1 == 0
    dcg = 1 / math.log2(3) + 1 / math.log2(5)
    idcg = 1 + 1 / math.log2(3)
    assert m.ndcg_at_10 == pytest.approx(dcg / idcg)
    assert m.recall == {1: 0.0, 2: 0.5, 5: 1.0}
    # corpus PND: positives vs every non-relevant doc: d1 loses to d0 and ties d4 (2 of 3),
    # d2 loses to d0, d4 (2 of 3)
    assert (m.errors_cos, m.pairs) == (4, 6)


def test_graded_ndcg_uses_linear_gains():
    m = evaluate_retrieval(Q, DOCS, [{0: 1, 2: 2}])
    dcg = 1 / math.log2(2) + 2 / math.log2(5)     # d0 at rank 1, d2 at rank 4
    idcg = 2 / math.log2(2) + 1 / math.log2(3)
    assert m.ndcg_at_10 == pytest.approx(dcg / idcg)


def test_retrieval_over_the_corpus_equals_candidates_of_the_whole_corpus():
    rng = np.random.default_rng(0)
    q, d = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(30, 8)).astype(np.float32)
    d *= rng.uniform(0.1, 5.0, size=(30, 1)).astype(np.float32)     # norms differ: cos != distance
    rel = [{int(i): 1 for i in rng.choice(30, 2, replace=False)} for _ in range(6)]
    pos = [sorted(r) for r in rel]
    neg = [[j for j in range(30) if j not in r] for r in rel]
    a = evaluate_retrieval(q, d, rel, chunk=4)
    b = evaluate_candidates(q, d, pos, neg)
    assert (a.errors_cos, a.errors_dist, a.pairs) == (b.errors_cos, b.errors_dist, b.pairs)
    assert a.errors_cos != a.errors_dist        # unnormalised: distance and cosine differ here
    assert a.mrr == pytest.approx(b.mrr) and a.map == pytest.approx(b.map)


def test_compare_metrics_reports_improvement_and_z():
    base = evaluate_candidates(Q, DOCS, [[2]], [[0, 1, 3]])
    tuned = evaluate_candidates(Q, DOCS, [[0]], [[1, 2, 3]])
    c = compare_metrics(base, tuned)
    assert c["metrics"]["pnd_cos"]["improvement"] == pytest.approx(1.0)   # 2/3 -> 0
    assert c["z_tests"]["pnd_cos"]["errors_base"] == 2 and c["z_tests"]["pnd_cos"]["errors_tuned"] == 0
    with pytest.raises(ValueError):
        compare_metrics(base, evaluate_candidates(Q, DOCS, [[0]], [[1]]))
