"""Hard negatives mined with the base query encoder, with a false-negative cutoff.

The most similar documents to a query become its negatives, except any whose score
exceeds ``cutoff`` times the score of the query's (first) positive: such a document is
probably relevant too (NV-Retriever's TopK-PercPos, used by Arctic-Embed; 0.95 default).
Candidates come from a qswap index (``DocumentIndex.search(q_emb, k)``) or from an
embedded corpus held in a :class:`DocTable`. Every score that decides is recomputed as
the cosine between the base query embedding and the cached document embedding, so the
cutoff compares like with like whatever the index's own scoring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from qswap.encoders import BaseEncoder
from qswap.errors import InvalidInputError
from qswap.index import IndexBackend
from qswap.tuning.data import Sample
from qswap.tuning.progress import encode_with_progress
from qswap.tuning.doc_cache import DocTable, StoredEmbeddings


@dataclass
class MiningStats:
    queries: int = 0
    candidates: int = 0
    dropped_positive: int = 0
    dropped_false_negative: int = 0
    mined: int = 0
    queries_without_negative: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def keep_negatives(cand_rows: Sequence[int], cand_scores: Sequence[float], positive_rows: set[int],
                   positive_score: float, cutoff: float | None, n: int,
                   stats: MiningStats | None = None) -> list[int]:
    """The ``n`` highest-scoring candidates that are not positives and score at most
    ``cutoff * positive_score`` (no score limit when ``cutoff`` is None)."""
    order = np.argsort(-np.asarray(cand_scores, dtype=np.float64), kind="stable")
    out: list[int] = []
    for i in order:
        if len(out) >= n:
            break
        row = int(cand_rows[i])
        if row in positive_rows or row in out:
            if stats is not None and row in positive_rows:
                stats.dropped_positive += 1
            continue
        if cutoff is not None and cand_scores[i] > cutoff * positive_score:
            if stats is not None:
                stats.dropped_false_negative += 1
            continue
        out.append(row)
    return out


def _candidates_from_index(index: IndexBackend, base: BaseEncoder, q_emb: np.ndarray, table: DocTable, k: int,
                           by_id: bool) -> list[list[int]]:
    base.space.require_same(index.space, "mining index")
    hits = index.search(q_emb, k)
    out = []
    for row_hits in hits:
        rows = []
        for h in row_hits:
            text = getattr(h, "text", None)
            if not text:
                raise InvalidInputError("the mining index returned a hit without its text",
                                        "build the index with stored document texts")
            rows.append(table.add(text, str(h.id) if by_id else None, index_id=str(h.id)))
        out.append(rows)
    return out


def mine_negatives(samples: list[Sample], base: BaseEncoder, table: DocTable, *, index: IndexBackend | None = None,
                   k: int = 30, n_negatives: int = 1, cutoff: float | None = 0.95,
                   cache_dir: Path | None = None, by_id: bool = False, progress: bool = True,
                   stored: StoredEmbeddings | None = None, chunk: int = 256,
                   encode_queries: Callable[[list[str]], np.ndarray] | None = None) -> MiningStats:
    """Add up to ``n_negatives`` mined negatives to each sample (after any it already has).

    Without ``index`` the candidates are the rows of ``table`` (an embedded corpus). The
    samples' positives must already be rows of ``table`` (keyed by id when ``by_id``).
    ``cutoff=None`` keeps the hardest non-positives unfiltered: for validation and test
    sets, whose errors must be able to exist for the base model. New documents take the
    index's ``stored`` embeddings when it holds them. ``encode_queries``: the base's query
    encoder to use (default ``base.encode_queries``; a run passes its fast runtime's).
    """
    if cutoff is not None and not 0 < cutoff <= 1.5:
        raise InvalidInputError(f"false-negative cutoff {cutoff} is out of range",
                                "give a fraction of the positive's score, e.g. 0.95")
    if n_negatives < 1 or k < n_negatives:
        raise InvalidInputError(f"cannot mine {n_negatives} negatives from the top {k}",
                                "use --mine-k >= --negatives >= 1")
    stats = MiningStats(queries=len(samples))
    if not samples:
        return stats
    q_emb = encode_with_progress(encode_queries or base.encode_queries, [s.query for s in samples],
                                 "mining: encoding queries", progress)
    pos_rows = [[_row(table, s, j, by_id) for j in range(len(s.positives))] for s in samples]
    if index is not None:
        cand = _candidates_from_index(index, base, q_emb, table, k, by_id)
        table.embed(base, cache_dir, progress=progress, stored=stored)
    else:
        emb = table.embed(base, cache_dir, progress=progress, stored=stored)
        if len(emb) == 0:
            raise InvalidInputError("no documents to mine negatives from", "give a corpus or an index")
        docs_u, qu = _unit(emb), _unit(q_emb)
        cand = []
        kk = min(k, len(docs_u))
        for s in range(0, len(samples), chunk):
            scores = qu[s:s + chunk] @ docs_u.T
            top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
            cand.extend(list(map(list, top)))
    docs_u, qu = _unit(table.emb), _unit(q_emb)
    for i, s in enumerate(samples):
        rows = cand[i]
        stats.candidates += len(rows)
        scores = docs_u[rows] @ qu[i] if rows else np.zeros(0)
        p_score = float(docs_u[pos_rows[i][0]] @ qu[i])
        keep = keep_negatives(rows, list(scores), set(pos_rows[i]), p_score, cutoff, n_negatives, stats)
        s.negatives = list(s.negatives) + [table.texts[r] for r in keep]
        if by_id:
            s.negative_ids = list(s.negative_ids or []) + [table.keys[r] for r in keep]
        stats.mined += len(keep)
        stats.queries_without_negative += not s.negatives
    return stats


def _row(table: DocTable, s: Sample, j: int, by_id: bool) -> int:
    if by_id and s.positive_ids:
        r = table.row(s.positive_ids[j])
        if r is None:
            raise InvalidInputError(f"{s.where}: positive {s.positive_ids[j]!r} is not in the corpus",
                                    "check the qrels against the corpus")
        return r
    return table.add(s.positives[j])
