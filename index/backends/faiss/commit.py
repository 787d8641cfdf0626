"""Changing a FAISS-backed DocumentIndex: add / upsert / delete / save as atomic commits, and undo.

Every change is one commit (see :mod:`qswap.index.backends.faiss.index`): new immutable files,
SQLite rows tagged with the next generation, then the manifest. A failure before the
manifest rename is undone in-process (:meth:`CommitMixin._undo`); a killed process is
recovered by the next writer (:mod:`qswap.index.backends.faiss.recovery`).

Changes are serialised by the index's change lock; searches are not blocked by them. A commit
writes and makes durable its whole generation while searches go on over the open one (its
SQLite rows are invisible to readers of the open generation, its files are new, and a FAISS
index that is snapshotted is a copy), then takes the readers' lock only to swap the new
generation in. A commit that writes no FAISS snapshot adds and removes its vectors in the
open FAISS index during that swap (memory only: copying a large index for every small change
would cost more than it saves).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from qswap.index.backends.faiss.recovery import peek_generation

log = logging.getLogger("qswap.index")


@dataclass
class _Edit:
    """Vectors to add to and rows to remove from a FAISS index."""

    rows: np.ndarray
    vectors: np.ndarray | None
    remove: np.ndarray

    def __bool__(self) -> bool:
        return bool(len(self.rows) or len(self.remove))

    def apply(self, index: faiss.Index, dim: int) -> None:
        if len(self.rows):
            faiss_index.add(index, self.rows, self.vectors, dim)
        if len(self.remove):
            faiss_index.remove(index, self.remove)


@dataclass
class _Generation:
    """A committed generation not yet swapped in; ``edit``, when set, still has to be applied to
    the open FAISS index (which is then ``index``)."""

    m: dict[str, Any]
    config: IndexConfig
    store: EmbeddingStore
    index: faiss.Index
    tombstones: np.ndarray
    count: int
    digest: int
    edit: _Edit | None


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
    _change_lock: Any
    _m: dict[str, Any]

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """One change at a time (searches go on meanwhile); the index must be writable."""
        with self._change_lock:
            self._check_writable()
            yield

    def _put(self, docs: list[Document], embeddings: np.ndarray, replace: bool) -> int:
        docs, x = documents_and_rows(docs, embeddings, self.full_dim)
        if x is None:
            return 0
        with self._changing():
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
        with self._changing():
            rows = self._docs.rows_for_ids(sorted(set(ids)), self._gen)
            if not rows:
                return 0
            self._commit(delete_rows=sorted(rows.values()))
            return len(rows)

    def save(self) -> None:
        """Write a FAISS snapshot now (rebuilding HNSW if it holds tombstones), so opening replays nothing.

        Changes are durable without this: each one is committed when its call returns.
        """
        with self._changing():
            if self._delta == 0 and not len(self._tombstones):
                return
            self._commit(snapshot=True, rebuild=bool(len(self._tombstones)))

    def _commit(self, *, new_docs: list[Document] = (), new_vecs: np.ndarray | None = None,  # type: ignore[assignment]
                delete_rows: list[int] = (), config: IndexConfig | None = None,  # type: ignore[assignment]
                snapshot: bool = False, rebuild: bool = False, progress: bool = False) -> None:
        """Apply one change durably (caller holds the change lock), then swap it in.

        ``progress`` shows a FAISS rebuild's progress."""
        gen = self._gen + 1
        created: list[str] = []
        nxt: _Generation | None = None
        try:
            nxt = self._prepare(gen, created, list(new_docs), new_vecs, [int(r) for r in delete_rows],
                                config or self._config, snapshot, rebuild, progress)
            write_manifest(self.path, nxt.m)
        except BaseException as e:
            if nxt is None or peek_generation(self.path) != gen:
                self._undo(created, e)
                raise
        assert nxt is not None
        stale = (set(self._m["files"]) | set(created)) - set(nxt.m["files"])  # replaced or merged away
        self._swap(nxt)
        for f in stale:   # no search uses them: those that started before the swap have ended
            (self.path / f).unlink(missing_ok=True)

    def _prepare(self, gen: int, created: list[str], new_docs: list[Document], new_vecs: np.ndarray | None,
                 delete_rows: list[int], cfg: IndexConfig, snapshot: bool, rebuild: bool,
                 progress: bool) -> _Generation:
        """Write generation ``gen`` (every file and SQLite row; not the manifest) while searches go on
        over the open one; the names of files written go to ``created`` as they are made."""
        start = self._store.rows_total
        chunks = list(self._store.chunks)
        inserts: list[tuple[int, str, str, str]] = []
        vecs = None
        if new_docs:
            vecs16 = np.asarray(new_vecs, dtype=np.float32).astype(DTYPE)
            ch = EmbeddingStore.write_chunk(self.path, start, vecs16, gen)
            created.append(ch.file)
            chunks.append(ch)
            inserts = [(start + n, d.id, d.text, meta_json(d.metadata)) for n, d in enumerate(new_docs)]
            vecs = vecs16.astype(np.float32)
        removed = self._docs.records(delete_rows, self._gen) if delete_rows else []
        if inserts or delete_rows:
            self._docs.apply(inserts, delete_rows, gen)
        digest = self._digest + sum(record_hash(*r) for r in inserts) - sum(record_hash(*r) for r in removed)
        count = self._count + len(inserts) - len(removed)
        store = self._store.with_chunks(chunks)
        edit = _Edit(np.arange(start, start + len(inserts), dtype=np.int64), vecs,
                     np.array(delete_rows, dtype=np.int64))
        index, tomb, faiss_rec, ntotal, pending = self._next_faiss(gen, cfg, store, edit, snapshot, rebuild,
                                                                   progress, created)
        i = EmbeddingStore.plan_merge(chunks)
        if i is not None:
            merged = store.merge(chunks[i:], gen)
            created.append(merged.file)
            chunks = chunks[:i] + [merged]
            store = store.with_chunks(chunks)
        m = make_manifest(generation=gen, space=self._space, config=cfg, faiss_rec=faiss_rec, chunks=chunks,
                          digest=digest_hex(digest), documents=count, faiss_vectors=ntotal,
                          build=self._m.get("build", {}), created_at=self._m.get("created_at", now_iso()))
        return _Generation(m=m, config=cfg, store=store, index=index, tombstones=tomb, count=count,
                           digest=digest, edit=pending)

    def _next_faiss(self, gen: int, cfg: IndexConfig, store: EmbeddingStore, edit: _Edit, snapshot: bool,
                    rebuild: bool, progress: bool, created: list[str]
                    ) -> tuple[faiss.Index, np.ndarray, dict[str, Any], int, _Edit | None]:
        """The FAISS side of generation ``gen``: (index, tombstones, manifest record, vectors, edit
        left to apply to the open index at the swap). A rebuilt or snapshotted index is a new
        object, so the open one serves searches unchanged until the swap."""
        index = self._faiss
        tomb = self._tombstones
        faiss_rec = dict(self._m["faiss"])
        delta = self._delta + len(edit.rows) + len(edit.remove)
        if len(edit.remove) and not faiss_index.can_remove(index):   # HNSW: searches skip tombstones
            tomb = np.union1d(tomb, edit.remove)
            edit = _Edit(edit.rows, edit.vectors, np.zeros(0, np.int64))
        ntotal = int(index.ntotal) + len(edit.rows) - len(edit.remove)
        if len(tomb) > max(self.TOMBSTONE_MIN, self.TOMBSTONE_FRACTION * ntotal):
            rebuild = True
        snapshot = snapshot or rebuild or delta >= max(self.SNAPSHOT_MIN_CHANGES, self.SNAPSHOT_FRACTION * ntotal)
        pending: _Edit | None = None
        if rebuild:
            index, plan = faiss_index.build(cfg, store, self._docs.live_rows(gen), progress=progress)
            faiss_rec.update(plan.to_dict())
            tomb = np.zeros(0, np.int64)
            ntotal = int(index.ntotal)
        elif edit and snapshot:
            index = faiss_index.clone(index)
            edit.apply(index, cfg.dim)
        elif edit:
            pending = edit
        if snapshot:
            name = faiss_name(gen)
            sha = faiss_index.write(index, self.path / name)
            created.append(name)
            faiss_rec.update(file=name, sha256=sha, generation=gen)
            delta = 0
        faiss_rec["changes_since"] = delta
        return index, tomb, faiss_rec, ntotal, pending

    def _swap(self, nxt: _Generation) -> None:
        """Make the committed generation ``nxt`` the open one (the only part searches wait for)."""
        with self._lock.write():
            if nxt.edit is not None:
                try:
                    nxt.edit.apply(nxt.index, nxt.config.dim)
                except BaseException as e:   # on disk the new generation is whole: reopening loads it
                    self._broken = f"{type(e).__name__}: {e}; the change is committed on disk"
                    log.error("index %s: %s", self.path, self._broken)
                    raise
            self._set_state(m=nxt.m, space=self._space, config=nxt.config, docs=self._docs, store=nxt.store,
                            index=nxt.index, tombstones=nxt.tombstones, count=nxt.count, digest=nxt.digest)

    def _undo(self, created: list[str], cause: BaseException) -> None:
        """Return to the committed generation after a change failed part-way (the open FAISS
        index and state were not touched: only SQLite rows and new files are undone)."""
        try:
            self._docs.rollback_after(self._gen)
            for f in created:
                (self.path / f).unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - report the first failure, refuse further use
            self._broken = f"{type(cause).__name__}: {cause}; undo failed: {e}"
            log.error("index %s: %s", self.path, self._broken)
