"""Searching a FAISS-backed DocumentIndex: ANN + rescoring, filtered and exact search, hits.

A mixin of :class:`~qswap.index.backends.faiss.index.DocumentIndex` (it uses the index's state:
``_faiss``, ``_store``, ``_docs``, ``_config``, ``_tombstones``, the read lock).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

import qswap.index.backends.faiss.faiss_index as faiss_index
from qswap.index.checks import as_queries, check_k
from qswap.matryoshka import truncate
from qswap.index.hit import FilterValue, Hit


class SearchMixin:
    """Read side of DocumentIndex."""

    # Filters matching at most this many documents are scored exactly over stored vectors.
    EXACT_FILTER_MAX = 20_000
    _gpu_lock: threading.Lock
    _lock: Any
    _config: Any
    _faiss: Any
    _store: Any
    _docs: Any

    def search(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
               with_text: bool = True) -> list[list[Hit]]:
        """Top-``k`` documents for each query row.

        ``queries``: (n, full_dim) float32 L2-normalised query embeddings (one row is fine).
        ``filter``: equality on top-level metadata fields (all must match). With rescoring
        on, scores are exact cosines with the stored full-dimension vectors.
        """
        q = as_queries(queries, self.full_dim)
        k = check_k(k)
        with self._lock.read():
            self._check_usable()
            if len(q) == 0 or self._count == 0:
                return [[] for _ in range(len(q))]
            if filter:
                rows, scores = self._search_filtered(q, k, filter)
            else:
                rows, scores = self._search_all(q, k)
            return self._hits(rows, scores, with_text)

    def search_exact(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
                     with_text: bool = False) -> list[list[Hit]]:
        """Brute-force top-``k`` over the stored full-dimension vectors (ground truth)."""
        q = as_queries(queries, self.full_dim)
        with self._lock.read():
            self._check_usable()
            rows = self._docs.filter_rows(filter, self._gen) if filter else self._docs.live_rows(self._gen)
            r, s = self._exact(q, min(int(k), len(rows)), rows)
            return self._hits(r, s, with_text)

    def _faiss_search(self, qt: np.ndarray, fetch: int, sel: faiss_index.Selector | None
                      ) -> tuple[np.ndarray, np.ndarray]:
        if sel is None and faiss_index.gpu_can_search(fetch):
            g = self._gpu_index()
            if g is not None:
                with self._gpu_lock:
                    return faiss_index.gpu_search(g, qt, fetch, self._config)
        return faiss_index.search(self._faiss, qt, fetch, self._config, sel)

    def _gpu_index(self) -> faiss_index.GpuIndex | None:
        if self._gpu is None and not self._gpu_tried:
            with self._gpu_lock:
                if self._gpu is None and not self._gpu_tried:
                    self._gpu_tried = True
                    self._gpu = faiss_index.to_gpu(self._faiss, self._config)
        return self._gpu

    def _search_all(self, q: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        kk = min(k, self._count)
        fetch = kk * int(self._config.oversample or 1) if self._rescoring else kk
        sel = None
        tomb = self._tombstones
        if len(tomb) and faiss_index.can_select(self._faiss):
            if self._tomb_selector is None:
                # Read-only after creation, so one selector serves concurrent searches.
                self._tomb_selector = faiss_index.bitmap_selector(tomb, self._store.rows_total, exclude=True)
            sel = self._tomb_selector
        elif len(tomb):
            fetch += len(tomb)
        fetch = max(1, min(fetch, int(self._faiss.ntotal)))
        d, i = self._faiss_search(truncate(q, self.dim), fetch, sel)
        cands = []
        for row in i:
            c = row[row >= 0]
            if len(tomb) and sel is None:
                c = c[~np.isin(c, tomb)]
            cands.append(c)
        if self._rescoring:
            return self._rescore(q, cands, kk)
        scores = []
        for j, row in enumerate(i):
            ok = row >= 0
            if len(tomb) and sel is None:
                ok &= ~np.isin(row, tomb)
            scores.append(d[j][ok][:kk])
            cands[j] = cands[j][:kk]
        return cands, scores

    def _search_filtered(self, q: np.ndarray, k: int, flt: dict[str, FilterValue]
                         ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        rows = self._docs.filter_rows(flt, self._gen)
        if len(rows) == 0:
            return [np.zeros(0, np.int64)] * len(q), [np.zeros(0, np.float32)] * len(q)
        kk = min(k, len(rows))
        if len(rows) <= self.EXACT_FILTER_MAX or not faiss_index.can_select(self._faiss):
            # Selective filters (and indexes that take no selector) are scored exactly:
            # k results whenever k documents match, and the exact cosine.
            return self._exact(q, kk, rows)
        sel = faiss_index.bitmap_selector(rows, self._store.rows_total)
        fetch = min(kk * int(self._config.oversample or 1) if self._rescoring else kk, len(rows))
        d, i = faiss_index.search(self._faiss, truncate(q, self.dim), fetch, self._config, sel)
        cands = [row[row >= 0] for row in i]
        short = [j for j, c in enumerate(cands) if len(c) < kk]
        if self._rescoring:
            out_r, out_s = self._rescore(q, cands, kk)
        else:
            out_r = [c[:kk] for c in cands]
            out_s = [d[j][i[j] >= 0][:kk] for j in range(len(q))]
        if short:
            # Graph search under a filter can end early; those queries get the exact answer.
            er, es = self._exact(q[short], kk, rows)
            for n, j in enumerate(short):
                out_r[j], out_s[j] = er[n], es[n]
        return out_r, out_s

    def _rescore(self, q: np.ndarray, cands: list[np.ndarray], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if len(cands) == 1:
            # One query (every search of a one-query request): its candidates' vectors in its
            # order, the same rows the general path picks out of the batch's (same scores).
            c = cands[0]
            s = self._store.gather(c) @ q[0]
            order = np.lexsort((c, -s))[:k]
            return [c[order]], [s[order]]
        allrows = np.unique(np.concatenate(cands)) if cands else np.zeros(0, np.int64)
        vecs = self._store.gather(allrows)
        out_r, out_s = [], []
        for j, c in enumerate(cands):
            s = vecs[np.searchsorted(allrows, c)] @ q[j]
            order = np.lexsort((c, -s))[:k]
            out_r.append(c[order])
            out_s.append(s[order])
        return out_r, out_s

    def _exact(self, q: np.ndarray, k: int, rows: np.ndarray, block: int = 65536
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-k of ``rows`` by exact cosine, scanning the float16 log in blocks."""
        n = len(q)
        if k <= 0 or len(rows) == 0:
            return [np.zeros(0, np.int64)] * n, [np.zeros(0, np.float32)] * n
        best_s = np.full((n, 0), -np.inf, dtype=np.float32)
        best_r = np.zeros((n, 0), dtype=np.int64)
        for r, x in self._store.iter_rows(rows, block):
            s = q @ x.T
            s = np.concatenate([best_s, s], axis=1)
            rr = np.concatenate([best_r, np.broadcast_to(r, (n, len(r)))], axis=1)
            if s.shape[1] > k:
                part = np.argpartition(-s, k - 1, axis=1)[:, :k]
                s = np.take_along_axis(s, part, axis=1)
                rr = np.take_along_axis(rr, part, axis=1)
            best_s, best_r = s, rr
        out_r, out_s = [], []
        for j in range(n):
            order = np.lexsort((best_r[j], -best_s[j]))[:k]
            out_r.append(best_r[j][order])
            out_s.append(best_s[j][order])
        return out_r, out_s

    def _hits(self, rows: list[np.ndarray], scores: list[np.ndarray], with_text: bool) -> list[list[Hit]]:
        # One query's rows need no np.unique (the store returns each row once anyway).
        wanted = rows[0] if len(rows) == 1 else np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
        recs = self._docs.fetch(wanted.tolist(), self._gen, with_text)
        out = []
        for r, s in zip(rows, scores):
            hits = []
            for row, score in zip(r.tolist(), s.tolist()):
                rec = recs.get(row)
                if rec is not None:  # a row FAISS returned is always live; guard anyway
                    hits.append(Hit(rec[0], score, rec[1], rec[2]))
            out.append(hits)
        return out
