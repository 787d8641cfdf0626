"""Changing a FAISS-backed DocumentIndex: add / upsert / delete / save as atomic commits, and undo.

Every change is one commit (see :mod:`qswap.index.backends.faiss.index`): new immutable files,
SQLite rows tagged with the next generation, then the manifest. A failure before the
manifest rename is undone in-process (:meth:`CommitMixin._undo`); a killed process is
recovered by the next writer (:mod:`qswap.index.backends.faiss.recovery`).
"""

from __future__ import annotations

import logging
from typing import Any

import faiss
import numpy as np

import qswap.index.backends.faiss.faiss_index as faiss_index
from qswap.errors import ConflictError
from qswap.index.config import IndexConfig
from qswap.index.corpus import Document
from qswap.index.checks import check_ids, documents_and_rows
from qswap.index.backends.faiss.docstore import digest_hex, meta_json, record_hash
from qswap.index.backends.faiss.embeddings import DTYPE, EmbeddingStore
from qswap.index.backends.faiss.generation import make_manifest
from qswap.index.manifest import faiss_name, now_iso, write_manifest
from qswap.index.backends.faiss.recovery import peek_generation, reconcile

log = logging.getLogger("qswap.index")


class CommitMixin:
    """Write side of DocumentIndex."""

    # A FAISS snapshot is written when this many rows changed since the last one ...
    SNAPSHOT_MIN_CHANGES = 1000
    # ... and they are at least this fraction of the index.
    SNAPSHOT_FRACTION = 0.05
    # HNSW cannot remove: it is rebuilt when tombstones pass both of these.
    TOMBSTONE_MIN = 1000
    TOMBSTONE_FRACTION = 0.2
    _lock: Any
    _m: dict[str, Any]

    def _put(self, docs: list[Document], embeddings: np.ndarray, replace: bool) -> int:
        docs, x = documents_and_rows(docs, embeddings, self.full_dim)
        if x is None:
            return 0
        with self._lock.write():
            self._check_writable()
            existing = self._docs.rows_for_ids([d.id for d in docs], self._gen)
            if existing and not replace:
                some = ", ".join(repr(i) for i in list(existing)[:5])
                raise ConflictError(f"{len(existing)} ids already in the index: {some}",
                                    "use upsert to replace them, or delete them first")
            self._commit(new_docs=docs, new_vecs=x, delete_rows=sorted(existing.values()))
        return len(docs)

    def delete(self, ids: list[str]) -> int:
        """Delete documents by external id; absent ids are ignored. Returns how many were deleted."""
        ids = list(ids)
        check_ids(ids)
        with self._lock.write():
            self._check_writable()
            rows = self._docs.rows_for_ids(sorted(set(ids)), self._gen)
            if not rows:
                return 0
            self._commit(delete_rows=sorted(rows.values()))
            return len(rows)

    def save(self) -> None:
        """Write a FAISS snapshot now (rebuilding HNSW if it holds tombstones), so opening replays nothing.

        Changes are durable without this: each one is committed when its call returns.
        """
        with self._lock.read():
            self._check_writable()
            if self._delta == 0 and not len(self._tombstones):
                return
            rebuild = bool(len(self._tombstones))
            prebuilt = self._prebuild(self._config) if rebuild else None
        with self._lock.write():
            self._check_writable()
            self._commit(snapshot=True, rebuild=rebuild, prebuilt=prebuilt)

    def _commit(self, *, new_docs: list[Document] = (), new_vecs: np.ndarray | None = None,  # type: ignore[assignment]
                delete_rows: list[int] = (), config: IndexConfig | None = None,  # type: ignore[assignment]
                snapshot: bool = False, rebuild: bool = False,
                prebuilt: tuple[int, faiss.Index, dict[str, Any]] | None = None) -> None:
        """Apply one change durably (caller holds the write lock).

        ``prebuilt``: a FAISS index built for generation ``prebuilt[0]``, used for a rebuild
        if no commit happened since (and nothing else changes in this one).
        """
        gen = self._gen + 1
        cfg = config or self._config
        created: list[str] = []
        touched_faiss = False
        start = self._store.rows_total
        chunks = list(self._store.chunks)
        delete_rows = [int(r) for r in delete_rows]
        committed = False
        try:
            inserts: list[tuple[int, str, str, str]] = []
            vecs16 = None
            if new_docs:
                vecs16 = np.asarray(new_vecs, dtype=np.float32).astype(DTYPE)
                ch = EmbeddingStore.write_chunk(self.path, start, vecs16, gen)
                created.append(ch.file)
                chunks.append(ch)
                inserts = [(start + n, d.id, d.text, meta_json(d.metadata)) for n, d in enumerate(new_docs)]
            removed = self._docs.records(delete_rows, self._gen) if delete_rows else []
            if inserts or delete_rows:
                self._docs.apply(inserts, delete_rows, gen)
            digest = self._digest + sum(record_hash(*r) for r in inserts) - sum(record_hash(*r) for r in removed)
            count = self._count + len(inserts) - len(removed)
            store = self._store.with_chunks(chunks)

            index = self._faiss
            tomb = self._tombstones
            delta = self._delta + len(inserts) + len(delete_rows)
            faiss_rec = dict(self._m["faiss"])
            if not rebuild:
                touched_faiss = bool(inserts or delete_rows)
                if inserts:
                    new_rows = np.arange(start, start + len(inserts), dtype=np.int64)
                    faiss_index.add(index, new_rows, vecs16.astype(np.float32), cfg.dim)
                if delete_rows:
                    if faiss_index.can_remove(index):
                        faiss_index.remove(index, np.array(delete_rows, dtype=np.int64))
                    else:
                        tomb = np.union1d(tomb, np.array(delete_rows, dtype=np.int64))
                if len(tomb) > max(self.TOMBSTONE_MIN, self.TOMBSTONE_FRACTION * index.ntotal):
                    rebuild = True
            if rebuild:
                if prebuilt is not None and prebuilt[0] == self._gen and not inserts and not delete_rows:
                    index, plan_rec = prebuilt[1], prebuilt[2]
                else:
                    index, plan = faiss_index.build(cfg, store, self._docs.live_rows(gen))
                    plan_rec = plan.to_dict()
                faiss_rec.update(plan_rec)
                tomb = np.zeros(0, np.int64)
                snapshot = True
            if snapshot or delta >= max(self.SNAPSHOT_MIN_CHANGES, self.SNAPSHOT_FRACTION * index.ntotal):
                name = faiss_name(gen)
                sha = faiss_index.write(index, self.path / name)
                created.append(name)
                faiss_rec.update(file=name, sha256=sha, generation=gen)
                delta = 0
            faiss_rec["changes_since"] = delta

            i = EmbeddingStore.plan_merge(chunks)
            if i is not None:
                merged = store.merge(chunks[i:], gen)
                created.append(merged.file)
                chunks = chunks[:i] + [merged]
                store = store.with_chunks(chunks)

            m = make_manifest(generation=gen, space=self._space, config=cfg, faiss_rec=faiss_rec, chunks=chunks,
                              digest=digest_hex(digest), documents=count, faiss_vectors=int(index.ntotal),
                              build=self._m.get("build", {}), created_at=self._m.get("created_at", now_iso()))
            write_manifest(self.path, m)
            committed = True
        except BaseException as e:
            if not committed and peek_generation(self.path) != gen:
                self._undo(created, touched_faiss, e)
                raise
            committed = True
        stale = (set(self._m["files"]) | set(created)) - set(m["files"])  # replaced or merged away
        self._set_state(m=m, space=self._space, config=cfg, docs=self._docs, store=store, index=index,
                        tombstones=tomb, count=count, digest=digest)
        for f in stale:
            (self.path / f).unlink(missing_ok=True)

    def _undo(self, created: list[str], touched_faiss: bool, cause: BaseException) -> None:
        """Return to the committed generation after a change failed part-way."""
        try:
            self._docs.rollback_after(self._gen)
            for f in created:
                (self.path / f).unlink(missing_ok=True)
            if touched_faiss:
                index = faiss_index.read(self.path / self._m["faiss"]["file"])
                live = self._docs.live_rows(self._gen)
                self._tombstones = reconcile(index, live, self._store, self.dim)
                self._faiss = index
                self._gpu = None
                self._gpu_tried = False
                self._tomb_selector = None
                self._faiss_nbytes = None
        except Exception as e:  # noqa: BLE001 - report the first failure, refuse further use
            self._broken = f"{type(cause).__name__}: {cause}; undo failed: {e}"
            log.error("index %s: %s", self.path, self._broken)
