"""The guard's evaluator over a served index: encoders judged on sentinel folders.

``qswap serve --sentinels DIR`` loads one sentinel per sub-folder of ``DIR`` (BEIR layout
without a corpus: the corpus is the served index)::

    DIR/<name>/queries.jsonl          {"_id", "text"} a line
    DIR/<name>/qrels/test.tsv         query-id  corpus-id  score   (corpus ids are index ids)
    DIR/<name>/sentinel.json          optional: {"lang": "de", ...} (``qswap sentinels make`` writes it)

Every registration then evaluates the new encoder on every sentinel against the base and
against each encoder currently behind an alias (the ones it may replace): queries encoded
by the server's own backend (``Backend.encode``, what serves search; in a running server as
jobs of its batch worker, through the cost gate: :mod:`qswap.server.serving.background`), scored exactly against
the index's stored document vectors (the vectors that re-rank every search), compared per
query by :mod:`qswap.guard.checks` (Wilcoxon on nDCG@10, Holm over the sentinels). Query
embeddings are cached per (encoder, sentinel): encoders are immutable, so the base and the
incumbents cost one encoding each for the server's lifetime.

Evaluations run one at a time on their own thread (``qswap-guard``); the batch worker keeps
serving meanwhile, its token slices interleaving the guard's chunks with the searches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

import numpy as np

from qswap.errors import QswapError
from qswap.guard.checks import guard_record, judge_sentinel
from qswap.guard.evaluation import evaluate_retrieval
from qswap.guard.record import GuardRecord
from qswap.guard.sentinels import IndexSentinel, sentinel_coverage, sentinels_fingerprint

__all__ = ["EvaluationCancelled", "GuardEvaluator"]

log = logging.getLogger("qswap.server")   # it runs inside the server: its log stream

_ENCODE_CHUNK = 32          # queries per forward pass: small, so serving batches interleave
_PROGRESS_EVERY_S = 5.0
_CACHED_ENCODERS = 16       # query-embedding sets kept (base + incumbents + recent)

Encode = Callable[[list[str], list[str]], np.ndarray]


class EvaluationCancelled(QswapError):
    """The server is shutting down: the evaluation stopped without a verdict (a restart runs it again)."""


class GuardEvaluator:
    """Evaluates encoders on the sentinels with the server's own backend and index."""

    def __init__(self, sentinels: list[IndexSentinel], index: Any, encode: Encode, metrics: Any = None,
                 alpha: float = 0.05, min_queries: int = 1) -> None:
        self.sentinels = sentinels
        self.index = index
        self.encode = encode
        self.metrics = metrics
        self.alpha = alpha
        self.min_queries = min_queries
        self.fingerprint = sentinels_fingerprint(sentinels)
        self._emb: OrderedDict[str, list[np.ndarray]] = OrderedDict()
        self._emb_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qswap-guard")
        self._closing = threading.Event()

    @property
    def queries(self) -> int:
        return sum(len(s.qids) for s in self.sentinels)

    def summary(self) -> list[dict[str, Any]]:
        return [{"name": s.name, "lang": s.lang, "queries": len(s.qids)} for s in self.sentinels]

    def check_coverage(self) -> None:
        """Log a warning for every sentinel whose judged documents the index no longer holds
        (deleted since the sentinels were built): its judgements are dropped, and a sentinel
        left with fewer than ``min_queries`` judged queries makes every verdict
        ``insufficient_evidence`` until it is rebuilt. The server starts either way."""
        ids, _ = self.index.export_embeddings()
        for c in sentinel_coverage(self.sentinels, set(ids)):
            if c["judgements_dropped"]:
                log.warning("sentinel judgements dropped: documents not in the index",
                            extra={"sentinel": c["name"], "judgements_dropped": c["judgements_dropped"],
                                   "queries": c["queries"], "queries_left": c["queries_left"],
                                   "min_queries": self.min_queries,
                                   "enough": c["queries_left"] >= self.min_queries})

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the guard thread (evaluations never overlap)."""
        return self._pool.submit(fn)

    def closing(self) -> bool:
        """Whether :meth:`close` was called (a running evaluation stops at its next chunk)."""
        return self._closing.is_set()

    def close(self) -> None:
        """Drop queued evaluations and stop the running one at its next chunk (shutdown)."""
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- evaluation -----------------------------------------------------------------------------

    def _embeddings(self, key: str, version: str, progress: Callable[[int], None]) -> list[np.ndarray]:
        cache_id = f"{key}#{version}"   # the files, not the name: a key re-registered is another encoder
        with self._emb_lock:
            if cache_id in self._emb:
                self._emb.move_to_end(cache_id)
                return self._emb[cache_id]
        out = []
        for s in self.sentinels:
            # Chunks of similar length (longest first): each chunk is padded to its own longest
            # query, so sorting the whole set once pads far less than chunks in file order.
            order = sorted(range(len(s.texts)), key=lambda i: -len(s.texts[i]))
            emb = np.empty((len(s.texts), 0), dtype=np.float32)
            for i in range(0, len(order), _ENCODE_CHUNK):
                if self._closing.is_set():
                    raise EvaluationCancelled("the guard evaluation was cancelled: the server is shutting down",
                                              "a restart evaluates the encoder again")
                rows = order[i:i + _ENCODE_CHUNK]
                part = np.asarray(self.encode([s.texts[j] for j in rows], [key] * len(rows)), dtype=np.float32)
                if emb.shape[1] == 0:
                    emb = np.empty((len(s.texts), part.shape[1]), dtype=np.float32)
                emb[rows] = part
                progress(len(rows))
            out.append(emb)
        with self._emb_lock:
            self._emb[cache_id] = out
            while len(self._emb) > _CACHED_ENCODERS:
                self._emb.popitem(last=False)
        return out

    def warm(self, keys: list[str], versions: Mapping[str, str] | None = None) -> None:
        """Encode the sentinels' queries for ``keys`` now (at start: the base and the aliased
        encoders), so a registration only encodes the new encoder.

        Args:
            keys: encoder keys.
            versions: key -> digest of its files (what the cached embeddings belong to).
        """
        t0 = time.perf_counter()
        for key in keys:
            self._embeddings(key, (versions or {}).get(key, key), lambda n: None)
        log.info("guard warmed up", extra={"encoders": keys, "queries": self.queries * len(keys),
                                           "seconds": round(time.perf_counter() - t0, 1)})

    def forget(self, key: str) -> None:
        """Drop the cached query embeddings of an encoder (deleted)."""
        with self._emb_lock:
            for cache_id in [c for c in self._emb if c.rpartition("#")[0] == key]:
                del self._emb[cache_id]

    def evaluate(self, key: str, against: list[str], versions: Mapping[str, str] | None = None) -> GuardRecord:
        """The guard record of ``key`` against every encoder of ``against`` (base first), on
        every sentinel, with the per-sentinel table, timings and the sentinels' fingerprint.

        Args:
            key: the encoder judged.
            against: reference encoders (base first).
            versions: key -> digest of its files, naming cached query embeddings.

        Returns:
            The guard record; its ``verdict`` is ``passed``, ``refused`` or
            ``insufficient_evidence`` (a sentinel left with fewer than ``min_queries`` judged
            queries in the index).
        """
        t0 = time.perf_counter()
        refs = list(dict.fromkeys(against))
        ver = {k: (versions or {}).get(k, k) for k in [key, *refs]}
        with self._emb_lock:
            to_encode = sum(f"{k}#{ver[k]}" not in self._emb for k in [key, *refs])
        total = to_encode * self.queries
        state = {"done": 0, "last": t0}

        def progress(n: int) -> None:
            state["done"] += n
            now = time.perf_counter()
            if now - state["last"] >= _PROGRESS_EVERY_S:
                state["last"] = now
                log.info("guard evaluation progress", extra={
                    "encoder": key, "queries_encoded": state["done"], "queries_total": total,
                    "seconds": round(now - t0, 1)})

        log.info("guard evaluation started", extra={"encoder": key, "against": refs,
                                                    "sentinels": len(self.sentinels), "queries_total": total})
        new = self._embeddings(key, ver[key], progress)
        ref_emb = {r: self._embeddings(r, ver[r], progress) for r in refs}
        t_enc = time.perf_counter() - t0
        ids, vectors = self.index.export_embeddings()
        rows = {d: i for i, d in enumerate(ids)}
        docs = np.asarray(vectors, dtype=np.float32)
        checks = []
        for si, s in enumerate(self.sentinels):
            keep, rel = [], []
            for qi, qrel in enumerate(s.qrels):
                r = {rows[d]: g for d, g in qrel.items() if d in rows}
                if r:   # documents deleted from the index since start leave their queries out
                    keep.append(qi)
                    rel.append(r)
            if len(keep) < self.min_queries:   # judged documents deleted: too little left to judge
                checks += judge_sentinel(s.name, None, dict.fromkeys(refs), n=len(keep), lang=s.lang,
                                         min_queries=self.min_queries)
                continue
            after = evaluate_retrieval(new[si][keep], docs, rel, ks=(10,))
            before = {r: evaluate_retrieval(ref_emb[r][si][keep], docs, rel, ks=(10,)) for r in refs}
            checks += judge_sentinel(s.name, after, before, n=len(keep), lang=s.lang, min_queries=self.min_queries)
        record = guard_record(checks, self.alpha, self.min_queries).model_copy(update={
            "source": "server", "sentinels": self.fingerprint, "against": refs, "evaluated_at": time.time(),
            "seconds": round(time.perf_counter() - t0, 3), "encode_seconds": round(t_enc, 3),
            "index_documents": len(ids)})
        log.info("guard evaluation done", extra={"encoder": key, "verdict": record.verdict,
                                                 "seconds": record.seconds,
                                                 "regressed": [f"{c.name} vs {c.against}" for c in record.regressed()]})
        return record
