"""Retrieval quality of a query encoder against frozen document embeddings.

Two settings share one per-query computation:

- :func:`evaluate_candidates`: each query has its own positives and negatives (the
  adiabatic paper's triplet data). PND counts every (positive, negative) pair where the
  positive is not closer; MRR, MAP and P@1 rank the query's candidates.
- :func:`evaluate_retrieval`: each query against a whole corpus (BEIR): nDCG@10,
  recall@k, MRR, MAP, P@1, and PND over (relevant, every non-relevant document) pairs.

PND is reported by cosine and by euclidean distance (they coincide for L2-normalised
embeddings). Ties count as errors: "the positive does not turn out to be closer".
Rankings are by cosine; nDCG uses linear gains, like trec_eval.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from qswap.errors import InvalidInputError
from qswap.guard.stats import compare_counts, improvement


NDCG_K = 10
_DISCOUNTS = 1.0 / np.log2(np.arange(2, NDCG_K + 2))


def ndcg_at_10(ranked_grades: np.ndarray | Sequence[float], relevant_grades: np.ndarray | Sequence[float]) -> float:
    """nDCG@10 with linear gains (as trec_eval): the one definition the guard, tuning and the
    benchmarks score with.

    Args:
        ranked_grades: the grades of the ranking's documents, best first (0 for a document
            with no judgement); only the first 10 count.
        relevant_grades: the grades of every judged document of the query (the ideal ranking
            sorts the positive ones).

    Returns:
        DCG@10 over the ideal DCG@10; 0.0 when no document is relevant.
    """
    gains = np.asarray(ranked_grades, dtype=np.float64)[:NDCG_K]
    ideal = np.sort(np.asarray(relevant_grades, dtype=np.float64))[::-1][:NDCG_K]
    ideal = ideal[ideal > 0]
    if not ideal.size:
        return 0.0
    return float((gains * _DISCOUNTS[:len(gains)]).sum() / (ideal * _DISCOUNTS[:len(ideal)]).sum())


@dataclass
class RankingMetrics:
    """Averages over queries, plus the raw counts the Z-test needs."""

    queries: int = 0
    pnd_cos: float = 0.0
    pnd_dist: float = 0.0
    errors_cos: int = 0
    errors_dist: int = 0
    pairs: int = 0
    pnd_queries: int = 0      # queries that had at least one (positive, negative) pair
    mrr: float = 0.0
    map: float = 0.0
    p_at_1: float = 0.0
    hits_at_1: int = 0
    ndcg_at_10: float = 0.0
    recall: dict[int, float] = field(default_factory=dict)
    # One value per scored query, in query order: what the paired tests compare
    # ("ndcg_at_10", "rr", "pnd_errors", "pnd_pairs"). Left out of reports.
    per_query: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_query", None)
        d["recall"] = {str(k): v for k, v in self.recall.items()}
        return d


# (name, lower_is_better) of the averaged metrics compared between encoders.
METRICS = (("pnd_cos", True), ("pnd_dist", True), ("mrr", False), ("map", False),
           ("p_at_1", False), ("ndcg_at_10", False))


class _Accumulator:
    def __init__(self, ks: Sequence[int]) -> None:
        self.ks = tuple(ks)
        self.m = RankingMetrics()
        self._sums = {"pnd_cos": 0.0, "pnd_dist": 0.0, "mrr": 0.0, "map": 0.0, "p_at_1": 0.0,
                      "ndcg_at_10": 0.0}
        self._recall = {k: 0.0 for k in self.ks}
        self.m.per_query = {"ndcg_at_10": [], "rr": [], "pnd_errors": [], "pnd_pairs": []}

    def add(self, sim: np.ndarray, dist: np.ndarray, grades: np.ndarray) -> None:
        """One query: scores of its candidates and their relevance grades (0 = negative).

        Linear in the number of candidates per relevant document (no full sort), so a
        query against a whole corpus stays cheap.
        """
        rel = grades > 0
        pos = np.flatnonzero(rel)
        n_rel = len(pos)
        if n_rel == 0:
            return
        m, s = self.m, self._sums
        m.queries += 1
        n_neg = len(grades) - n_rel
        pq = m.per_query
        pq["pnd_errors"].append(0.0)
        pq["pnd_pairs"].append(0.0)
        if n_neg:
            e_cos = int((sim[~rel][None, :] >= sim[pos][:, None]).sum())
            e_dist = int((dist[~rel][None, :] <= dist[pos][:, None]).sum())
            pairs = n_rel * n_neg
            m.errors_cos += e_cos
            m.errors_dist += e_dist
            m.pairs += pairs
            m.pnd_queries += 1
            s["pnd_cos"] += e_cos / pairs
            s["pnd_dist"] += e_dist / pairs
            pq["pnd_errors"][-1], pq["pnd_pairs"][-1] = float(e_cos), float(pairs)
        # 1-based rank of each relevant document, ties broken by candidate order
        # (as a stable sort by descending score would).
        sp = sim[pos][:, None]
        idx = np.arange(len(sim))[None, :]
        ranks = np.sort(((sim[None, :] > sp) | ((sim[None, :] == sp) & (idx < pos[:, None]))).sum(1) + 1)
        s["mrr"] += 1.0 / ranks[0]
        pq["rr"].append(1.0 / float(ranks[0]))
        s["map"] += float(np.mean(np.arange(1, n_rel + 1) / ranks))
        hit = bool(ranks[0] == 1)
        s["p_at_1"] += hit
        m.hits_at_1 += hit
        k = min(NDCG_K, len(sim))
        top = np.argpartition(-sim, k - 1)[:k] if k < len(sim) else np.arange(len(sim))
        top = top[np.lexsort((top, -sim[top]))]
        ndcg = ndcg_at_10(grades[top], grades[rel])
        s["ndcg_at_10"] += ndcg
        pq["ndcg_at_10"].append(ndcg)
        for kk in self.ks:
            self._recall[kk] += float((ranks <= kk).sum()) / n_rel

    def result(self) -> RankingMetrics:
        m, q = self.m, max(self.m.queries, 1)
        for name in ("mrr", "map", "p_at_1", "ndcg_at_10"):
            setattr(m, name, self._sums[name] / q)
        pq = max(m.pnd_queries, 1)
        m.pnd_cos = self._sums["pnd_cos"] / pq
        m.pnd_dist = self._sums["pnd_dist"] / pq
        m.recall = {k: v / q for k, v in self._recall.items()}
        return m


def _check_dims(q_emb: np.ndarray, doc_emb: np.ndarray) -> None:
    if q_emb.ndim != 2 or doc_emb.ndim != 2 or q_emb.shape[1] != doc_emb.shape[1]:
        raise InvalidInputError(
            f"query embeddings {q_emb.shape} and document embeddings {doc_emb.shape} do not match",
            "encode queries and documents with encoders of one embedding space")


def _distances(q: np.ndarray, docs: np.ndarray, sim_dot: np.ndarray, doc_sq: np.ndarray) -> np.ndarray:
    q_sq = (q.astype(np.float64) ** 2).sum(-1, keepdims=True)
    return np.sqrt(np.maximum(q_sq + doc_sq[None, :] - 2.0 * sim_dot, 0.0))


def _cosines(q: np.ndarray, dot: np.ndarray, doc_norm: np.ndarray) -> np.ndarray:
    qn = np.linalg.norm(q.astype(np.float64), axis=-1, keepdims=True)
    return dot / np.maximum(qn * doc_norm[None, :], 1e-12)


def evaluate_candidates(q_emb: np.ndarray, doc_emb: np.ndarray,
                        positives: Sequence[Sequence[int]], negatives: Sequence[Sequence[int]],
                        ks: Sequence[int] = (1, 5, 10)) -> RankingMetrics:
    """Metrics of queries ranked against their own candidates (rows of ``doc_emb``)."""
    _check_dims(q_emb, doc_emb)
    if not (len(q_emb) == len(positives) == len(negatives)):
        raise InvalidInputError(f"{len(q_emb)} queries but {len(positives)} positive lists and "
                                f"{len(negatives)} negative lists", "pass one list per query")
    acc = _Accumulator(ks)
    docs = doc_emb.astype(np.float64)
    for i, (pos, neg) in enumerate(zip(positives, negatives)):
        idx = np.asarray(list(pos) + list(neg), dtype=np.int64)
        if len(idx) == 0:
            continue
        cand = docs[idx]
        dot = cand @ q_emb[i].astype(np.float64)
        sim = _cosines(q_emb[i][None, :], dot[None, :], np.linalg.norm(cand, axis=-1))[0]
        dist = _distances(q_emb[i][None, :], cand, dot[None, :], (cand ** 2).sum(-1))[0]
        grades = np.zeros(len(idx))
        grades[:len(pos)] = 1.0
        acc.add(sim, dist, grades)
    return acc.result()


def evaluate_retrieval(q_emb: np.ndarray, doc_emb: np.ndarray,
                       relevant: Sequence[Mapping[int, float]], ks: Sequence[int] = (10, 100),
                       chunk: int = 64, progress: bool = False) -> RankingMetrics:
    """Metrics of each query against the whole corpus ``doc_emb``.

    ``relevant[i]`` maps corpus rows to relevance grades (> 0 relevant) for query ``i``.
    """
    _check_dims(q_emb, doc_emb)
    if len(q_emb) != len(relevant):
        raise InvalidInputError(f"{len(q_emb)} queries but {len(relevant)} relevance maps",
                                "pass one relevance map per query")
    acc = _Accumulator(ks)
    docs = doc_emb.astype(np.float32)
    doc_norm = np.linalg.norm(docs.astype(np.float64), axis=-1)
    doc_sq = doc_norm ** 2
    starts: Iterable[int] = range(0, len(q_emb), chunk)
    if progress:
        from tqdm import tqdm
        starts = tqdm(list(starts), desc="evaluating", unit="chunk", leave=False)
    for s in starts:
        q = q_emb[s:s + chunk].astype(np.float32)
        dot = (q @ docs.T).astype(np.float64)
        sims = _cosines(q, dot, doc_norm)
        dists = _distances(q, docs, dot, doc_sq)
        for r in range(len(q)):
            grades = np.zeros(len(docs))
            for doc, g in relevant[s + r].items():
                grades[doc] = g
            acc.add(sims[r], dists[r], grades)
    return acc.result()


def compare_metrics(base: RankingMetrics, tuned: RankingMetrics) -> dict[str, Any]:
    """Improvement I of every metric and Z-tests of the PND error counts and P@1 misses."""
    if base.queries != tuned.queries or base.pairs != tuned.pairs:
        raise ValueError("base and tuned metrics come from different evaluation sets")
    out: dict[str, Any] = {"metrics": {}, "z_tests": {}}
    pairs = [(name, getattr(base, name), getattr(tuned, name), lower) for name, lower in METRICS]
    pairs += [(f"recall_at_{k}", base.recall[k], tuned.recall.get(k, 0.0), False) for k in sorted(base.recall)]
    for name, b, t, lower in pairs:
        imp = improvement(b, t, lower_is_better=lower)
        out["metrics"][name] = {"base": b, "tuned": t, "improvement": None if math.isinf(imp) else imp}
    if base.pairs:
        out["z_tests"]["pnd_cos"] = compare_counts(base.errors_cos, tuned.errors_cos, base.pairs).to_dict()
        out["z_tests"]["pnd_dist"] = compare_counts(base.errors_dist, tuned.errors_dist, base.pairs).to_dict()
    if base.queries:
        out["z_tests"]["p_at_1_misses"] = compare_counts(base.queries - base.hits_at_1,
                                                         tuned.queries - tuned.hits_at_1,
                                                         base.queries).to_dict()
    return out
