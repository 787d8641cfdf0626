"""The server's own regression guard: sentinel sets over the served index.

``qswap serve --sentinels DIR`` loads one sentinel per sub-folder of ``DIR`` (BEIR layout
without a corpus: the corpus is the served index)::

    DIR/<name>/queries.jsonl          {"_id", "text"} a line
    DIR/<name>/qrels/test.tsv         query-id  corpus-id  score   (corpus ids are index ids)
    DIR/<name>/sentinel.json          optional: {"lang": "de", ...} (``qswap sentinels make`` writes it)

Every registration then evaluates the new encoder on every sentinel against the base and
against each encoder currently behind an alias (the ones it may replace): queries encoded
by the server's own backend (``Backend.encode``, what serves search), scored exactly against
the index's stored document vectors (the vectors that re-rank every search), compared per
query by :mod:`qswap.tuning.guard` (Wilcoxon on nDCG@10, Holm over the sentinels). Query
embeddings are cached per (encoder, sentinel): encoders are immutable, so the base and the
incumbents cost one encoding each for the server's lifetime.

Evaluations run one at a time on their own thread (``qswap-guard``); the batch worker keeps
serving meanwhile (the pool's lock interleaves the two forward-pass streams chunk by chunk).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from qswap.errors import InvalidInputError
from qswap.server.errors import NotReadyError
from qswap.tuning.evaluation import evaluate_retrieval
from qswap.tuning.guard import guard_record, sentinel_check
from qswap.tuning.sentinels import SentinelSet, check_sentinels_in_index, load_sentinels, sentinels_fingerprint

__all__ = ["SentinelGuard", "SentinelSet", "check_sentinels_in_index", "load_sentinels"]

log = logging.getLogger("qswap.server")

_ENCODE_CHUNK = 32          # queries per forward pass: small, so serving batches interleave
_PROGRESS_EVERY_S = 5.0
_CACHED_ENCODERS = 16       # query-embedding sets kept (base + incumbents + recent)

Encode = Callable[[list[str], list[str]], np.ndarray]


class SentinelGuard:
    """Evaluates encoders on the sentinels with the server's own backend and index."""

    def __init__(self, sentinels: list[SentinelSet], index: Any, encode: Encode, metrics: Any = None,
                 alpha: float = 0.05) -> None:
        self.sentinels = sentinels
        self.index = index
        self.encode = encode
        self.metrics = metrics
        self.alpha = alpha
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

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the guard thread (evaluations never overlap)."""
        return self._pool.submit(fn)

    def close(self) -> None:
        """Drop queued evaluations and stop the running one at its next chunk (shutdown)."""
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- evaluation -----------------------------------------------------------------------------

    def _embeddings(self, key: str, progress: Callable[[int], None]) -> list[np.ndarray]:
        with self._emb_lock:
            if key in self._emb:
                self._emb.move_to_end(key)
                return self._emb[key]
        out = []
        for s in self.sentinels:
            # Chunks of similar length (longest first): each chunk is padded to its own longest
            # query, so sorting the whole set once pads far less than chunks in file order.
            order = sorted(range(len(s.texts)), key=lambda i: -len(s.texts[i]))
            emb = np.empty((len(s.texts), 0), dtype=np.float32)
            for i in range(0, len(order), _ENCODE_CHUNK):
                if self._closing.is_set():
                    raise NotReadyError("the guard evaluation was cancelled: the server is shutting down",
                                        "a restart evaluates the encoder again")
                rows = order[i:i + _ENCODE_CHUNK]
                part = np.asarray(self.encode([s.texts[j] for j in rows], [key] * len(rows)), dtype=np.float32)
                if emb.shape[1] == 0:
                    emb = np.empty((len(s.texts), part.shape[1]), dtype=np.float32)
                emb[rows] = part
                progress(len(rows))
            out.append(emb)
        with self._emb_lock:
            self._emb[key] = out
            while len(self._emb) > _CACHED_ENCODERS:
                self._emb.popitem(last=False)
        return out

    def warm(self, keys: list[str]) -> None:
        """Encode the sentinels' queries for ``keys`` now (at start: the base and the aliased
        encoders), so a registration only encodes the new encoder."""
        t0 = time.perf_counter()
        for key in keys:
            self._embeddings(key, lambda n: None)
        log.info("guard warmed up", extra={"encoders": keys, "queries": self.queries * len(keys),
                                           "seconds": round(time.perf_counter() - t0, 1)})

    def forget(self, key: str) -> None:
        """Drop the cached query embeddings of an encoder (deleted)."""
        with self._emb_lock:
            self._emb.pop(key, None)

    def evaluate(self, key: str, against: list[str]) -> dict[str, Any]:
        """The guard record of ``key`` against every encoder of ``against`` (base first), on
        every sentinel, with the per-sentinel table, timings and the sentinels' fingerprint."""
        t0 = time.perf_counter()
        refs = list(dict.fromkeys(against))
        with self._emb_lock:
            to_encode = sum(k not in self._emb for k in [key, *refs])
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
        new = self._embeddings(key, progress)
        ref_emb = {r: self._embeddings(r, progress) for r in refs}
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
            if not keep:
                raise InvalidInputError(f"sentinel {s.name}: none of its judged documents is left in the index",
                                        "rebuild the sentinels over the current index and restart")
            after = evaluate_retrieval(new[si][keep], docs, rel, ks=(10,))
            for r in refs:
                before = evaluate_retrieval(ref_emb[r][si][keep], docs, rel, ks=(10,))
                checks.append(sentinel_check(s.name, before, after, against=r, lang=s.lang))
        record = guard_record(checks, self.alpha)
        record.update({"source": "server", "sentinels": self.fingerprint, "against": refs,
                       "evaluated_at": time.time(), "seconds": round(time.perf_counter() - t0, 3),
                       "encode_seconds": round(t_enc, 3), "index_documents": len(ids)})
        log.info("guard evaluation done", extra={"encoder": key, "passed": record["passed"],
                                                 "seconds": record["seconds"],
                                                 "regressed": [f"{c['name']} vs {c['against']}"
                                                               for c in checks if c["degraded"]]})
        return record
