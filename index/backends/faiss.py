"""The FAISS backend: DocumentIndex, the embedded document index on disk and in memory.

State on disk is described by the manifest (see :mod:`qswap.index.manifest`); every change
is one *commit* that writes new immutable files (an embedding chunk, maybe a FAISS snapshot
or a merged chunk), commits the SQLite rows tagged with the new generation, then writes the
manifest. A process killed anywhere before the manifest rename leaves the previous
generation, which the next writer restores (SQLite rows of later generations are rolled
back, unlisted files removed); after the rename the new generation is complete.

The FAISS file is a snapshot: it is rewritten only when enough rows changed since the last
one (or on :meth:`DocumentIndex.save`), and opening an index replays the difference between
the snapshot's ids and the live rows, reading vectors from the float16 log.

Thread safety: searches share a read lock, changes take the write lock; a batch of queries
is one batched FAISS call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

import qswap
from qswap.atomic import recover_dir, remove_stale_temps
from qswap.index.errors import IndexCorruptError
from qswap.errors import ConflictError, InvalidInputError, NotFoundError, QswapError
import qswap.index.faiss_index as faiss_index
from qswap.locks import try_lock_exclusive
from qswap.index.config import IndexConfig
from qswap.index.corpus import Document, check_documents
from qswap.index.docstore import DOCS_FILE, SCHEMA_VERSION, DocStore, digest_hex, meta_json, record_hash
from qswap.index.hit import FilterValue, Hit
from qswap.index.embeddings import DTYPE, EMB_DIR, Chunk, EmbeddingStore, normalize_rows, truncate_rows
from qswap.index.manifest import (FAISS_DIR, FORMAT, FORMAT_VERSION, MANIFEST, faiss_name, now_iso,
                                  read_manifest, verify_files, write_manifest)
from qswap.index.rwlock import RWLock
from qswap.space import EmbeddingSpace

log = logging.getLogger("qswap.index")

LOCK_FILE = ".lock"
# Options that change what FAISS stores (a change re-indexes); the others are search-time.
_SHAPE_FIELDS = ("dim", "quant", "kind", "nlist", "hnsw_m", "ef_construction", "pq_m")

def lock_holder(path: Path) -> str:
    """Who holds the writer lock of ``path`` as recorded in its lock file ("process 123" or "unknown")."""
    try:
        pid = (path / LOCK_FILE).read_text().split()[0]
        return f"process {int(pid)}"
    except (OSError, IndexError, ValueError):
        return "another process or handle"


def acquire_writer_lock(path: Path) -> int:
    """Take the folder's writer lock (flock, released by the kernel if the process dies).

    The holder writes its pid into the lock file so that a refused writer can name it."""
    lock_file = path / LOCK_FILE
    try:
        fd = try_lock_exclusive(lock_file, "", "")
    except ConflictError:
        raise ConflictError(f"index {path} is open for writing by {lock_holder(path)}",
                            "stop that process (e.g. the server) or open this index read-only") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int | None) -> None:
    """Release a writer lock (closing the descriptor drops the flock)."""
    if fd is not None:
        os.close(fd)


def make_manifest(*, generation: int, space: EmbeddingSpace, config: IndexConfig, faiss_rec: dict[str, Any],
                  chunks: list[Chunk], digest: str, documents: int, faiss_vectors: int,
                  build: dict[str, Any], created_at: str) -> dict[str, Any]:
    """The manifest of one generation (every file it lists must already be on disk)."""
    files = {c.file: c.sha256 for c in chunks}
    files[faiss_rec["file"]] = faiss_rec["sha256"]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "qswap_version": qswap.__version__,
        "generation": generation,
        "created_at": created_at,
        "updated_at": now_iso(),
        "space": space.to_dict(),
        "fingerprint": space.fingerprint,
        "metric": "inner_product",
        "normalized": True,
        "full_dim": space.dim,
        "dim": config.dim,
        "config": config.index_dict(),
        "faiss": faiss_rec,
        "embeddings": {"dtype": "float16", "rows": sum(c.rows for c in chunks),
                       "chunks": [c.to_dict() for c in chunks]},
        "docstore": {"file": DOCS_FILE, "schema": SCHEMA_VERSION, "digest": digest},
        "counts": {"documents": documents, "rows": sum(c.rows for c in chunks),
                   "faiss_vectors": faiss_vectors},
        "files": files,
        "build": build,
    }


def write_first_generation(root: Path, *, space: EmbeddingSpace, config: IndexConfig, chunks: list[Chunk],
                           build: dict[str, Any], progress: bool = False) -> dict[str, Any]:
    """Index the rows of a freshly written folder (docs.sqlite + chunks) as generation 1."""
    store = EmbeddingStore(root, space.dim, chunks)
    docs = DocStore(root / DOCS_FILE)
    try:
        live = docs.live_rows(1)
        started = build.get("started_at")
        index, plan = faiss_index.build(config, store, live, progress=progress)
        name = faiss_name(1)
        sha = faiss_index.write(index, root / name)
        if started is not None:
            build = {**build, "seconds": round(time.time() - float(started), 3)}
        m = make_manifest(
            generation=1, space=space, config=config,
            faiss_rec={"file": name, "sha256": sha, "generation": 1, "changes_since": 0, **plan.to_dict()},
            chunks=chunks, digest=docs.digest(1), documents=len(live), faiss_vectors=int(index.ntotal),
            build=build, created_at=now_iso())
        write_manifest(root, m)
    finally:
        docs.close()
    return m


class DocumentIndex:
    """A FAISS document index with its float16 embedding log and SQLite document store."""

    # A FAISS snapshot is written when this many rows changed since the last one ...
    SNAPSHOT_MIN_CHANGES = 1000
    # ... and they are at least this fraction of the index.
    SNAPSHOT_FRACTION = 0.05
    # HNSW cannot remove: it is rebuilt when tombstones pass both of these.
    TOMBSTONE_MIN = 1000
    TOMBSTONE_FRACTION = 0.2
    # Filters matching at most this many documents are scored exactly over stored vectors.
    EXACT_FILTER_MAX = 20_000

    def __init__(self) -> None:  # use open(), build_index() or create_index()
        self._lock = RWLock()
        self._gpu_lock = threading.Lock()
        self._gpu: faiss_index.GpuIndex | None = None
        self._gpu_tried = False
        self._closed = False
        self._broken: str | None = None
        self._lock_fd: int | None = None
        self._ephemeral = False
        self._owns_docs = True
        self._parent: DocumentIndex | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: Path, *, read_only: bool = False, expected_space: EmbeddingSpace | None = None,
             verify: bool = True) -> "DocumentIndex":
        """Open an index folder, checking manifest, checksums, document digest and space.

        ``read_only`` opens without the writer lock (any number of readers, e.g. CLI
        searches while a server runs). ``expected_space`` refuses an index of another
        embedding space with :class:`SpaceMismatchError`. ``verify=False`` skips hashing
        files (faster start for large indexes; structure is still checked).
        """
        path = Path(path)
        if not read_only:
            recover_dir(path)
        if not path.is_dir():
            read_manifest(path)  # raises NotFoundError with the right hint
        last: QswapError | None = None
        for _ in range(3):
            gen_before = _peek_generation(path)
            try:
                return cls._open_once(path, read_only, expected_space, verify)
            except IndexCorruptError as e:
                # A writer in another process may have committed (and removed old files)
                # while we read: try again on the new generation.
                last = e
                if not read_only or _peek_generation(path) == gen_before:
                    raise
        assert last is not None
        raise last

    @classmethod
    def _open_once(cls, path: Path, read_only: bool, expected_space: EmbeddingSpace | None,
                   verify: bool) -> "DocumentIndex":
        self = cls()
        self.path = path
        self._read_only = read_only
        read_manifest(path)
        if not read_only:
            self._lock_fd = acquire_writer_lock(path)
        docs: DocStore | None = None
        try:
            m = read_manifest(path)  # again: a writer may have committed before we locked
            try:
                space = EmbeddingSpace.from_dict(m["space"])
            except InvalidInputError as e:
                raise IndexCorruptError(f"{path / MANIFEST}: {e.message}", e.hint) from None
            if expected_space is not None:
                expected_space.require_same(space, f"index {path}")
            config = IndexConfig.from_dict(m["config"])
            gen = int(m["generation"])
            full_dim = int(m["full_dim"])
            if full_dim != space.dim or int(m["dim"]) != config.dim:
                raise IndexCorruptError(f"{path / MANIFEST}: dimensions disagree (full_dim {full_dim}, space "
                                     f"{space.dim}, dim {m['dim']}, config {config.dim})",
                                     "restore the index folder or rebuild it")
            chunks = [Chunk.from_dict(c) for c in m["embeddings"]["chunks"]]
            for c in chunks:
                if m["files"].get(c.file) != c.sha256:
                    raise IndexCorruptError(f"{path / MANIFEST}: chunk {c.file} is not listed with its checksum",
                                         "restore the index folder or rebuild it")
            if verify:
                verify_files(path, m["files"])
            store = EmbeddingStore(path, full_dim, chunks)
            docs = DocStore(path / DOCS_FILE, read_only=read_only)
            if not read_only:
                undone = docs.rollback_after(gen)
                if undone:
                    log.warning("%s: rolled back %d document changes of an interrupted write", path, undone)
                _remove_orphans(path, m)
            live = docs.live_rows(gen)
            want = int(m["counts"]["documents"])
            if len(live) != want:
                raise IndexCorruptError(f"document store holds {len(live)} live documents, manifest says {want}",
                                     "restore the index folder or rebuild it")
            if len(live) and int(live[-1]) >= store.rows_total:
                raise IndexCorruptError("document store refers to embedding rows that do not exist",
                                     "restore the index folder or rebuild it")
            digest = docs.digest(gen) if verify else m["docstore"]["digest"]
            if digest != m["docstore"]["digest"]:
                raise IndexCorruptError(f"document store content differs from the manifest (digest {digest[:12]}... "
                                     f"!= {m['docstore']['digest'][:12]}...)",
                                     "docs.sqlite was edited or damaged; restore it or rebuild the index")
            index = faiss_index.read(path / m["faiss"]["file"])
            if index.d != config.dim:
                raise IndexCorruptError(f"FAISS file has dimension {index.d}, manifest says {config.dim}",
                                     "restore the index folder or rebuild it")
            tombstones = _reconcile(index, live, store, config.dim)
        except (KeyError, TypeError, ValueError) as e:
            if docs is not None:
                docs.close()
            release_lock(self._lock_fd)
            self._lock_fd = None
            raise IndexCorruptError(f"{path / MANIFEST} is malformed ({type(e).__name__}: {e})",
                                 "restore the index folder or rebuild it") from None
        except BaseException:
            if docs is not None:
                docs.close()
            release_lock(self._lock_fd)
            self._lock_fd = None
            raise
        self._set_state(m=m, space=space, config=config, docs=docs, store=store, index=index,
                        tombstones=tombstones, count=len(live), digest=int(m["docstore"]["digest"], 16))
        return self

    def _set_state(self, *, m: dict[str, Any], space: EmbeddingSpace, config: IndexConfig, docs: DocStore,
                   store: EmbeddingStore, index: faiss.Index, tombstones: np.ndarray, count: int,
                   digest: int) -> None:
        self._m = m
        self._gen = int(m["generation"])
        self._space = space
        self._config = config
        self._docs = docs
        self._store = store
        self._faiss = index
        self._tombstones = tombstones
        self._count = count
        self._digest = digest
        self._delta = int(m["faiss"].get("changes_since", 0))
        self._gpu = None
        self._gpu_tried = False
        # Per-generation caches (state is immutable between commits).
        self._tomb_selector: faiss_index.Selector | None = None
        self._faiss_nbytes: int | None = None

    # ------------------------------------------------------------------ properties
    @property
    def space(self) -> EmbeddingSpace:
        """Embedding space of the stored documents (queries must come from the same one)."""
        return self._space

    @property
    def dim(self) -> int:
        """Dimensions kept in FAISS (Matryoshka prefix)."""
        return int(self._config.dim)

    @property
    def full_dim(self) -> int:
        """Dimensions of queries and stored embeddings."""
        return self._space.dim

    @property
    def count(self) -> int:
        """Number of live documents."""
        return self._count

    @property
    def config(self) -> IndexConfig:
        return self._config

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def manifest(self) -> dict[str, Any]:
        return dict(self._m)

    @property
    def _rescoring(self) -> bool:
        return bool(self._config.rescore) and not (self._config.is_exact and self.dim == self.full_dim)

    def _check_usable(self) -> None:
        node: DocumentIndex | None = self
        while node is not None:  # a variant lives as long as the index it was made from
            if node._closed:
                raise InvalidInputError("the index is closed", "open it again")
            node = node._parent
        if self._broken:
            raise IndexCorruptError(f"the index is in an unknown state after a failed change ({self._broken})",
                                 "reopen the index")

    def _check_writable(self) -> None:
        self._check_usable()
        if self._ephemeral:
            raise InvalidInputError("this is an in-memory variant of an index", "change the index it came from")
        if self._read_only:
            raise InvalidInputError(f"index {self.path} was opened read-only", "open it without read_only to change it")

    # ------------------------------------------------------------------ search
    def search(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
               with_text: bool = True) -> list[list[Hit]]:
        """Top-``k`` documents for each query row.

        ``queries``: (n, full_dim) float32 L2-normalised query embeddings (one row is fine).
        ``filter``: equality on top-level metadata fields (all must match). With rescoring
        on, scores are exact cosines with the stored full-dimension vectors.
        """
        q = _as_queries(queries, self.full_dim)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InvalidInputError(f"k must be a positive integer, got {k!r}", "ask for at least one result")
        k = int(k)
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
        q = _as_queries(queries, self.full_dim)
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
        d, i = self._faiss_search(truncate_rows(q, self.dim), fetch, sel)
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
        d, i = faiss_index.search(self._faiss, truncate_rows(q, self.dim), fetch, self._config, sel)
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
        allrows = np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
        recs = self._docs.fetch(allrows.tolist(), self._gen, with_text)
        out = []
        for r, s in zip(rows, scores):
            hits = []
            for row, score in zip(r.tolist(), s.tolist()):
                rec = recs.get(row)
                if rec is not None:  # a row FAISS returned is always live; guard anyway
                    hits.append(Hit(rec[0], float(score), rec[1], rec[2]))
            out.append(hits)
        return out

    # ------------------------------------------------------------------ reads by id
    def get(self, ids: list[str]) -> list[Document | None]:
        """Documents by external id (``None`` where absent)."""
        with self._lock.read():
            self._check_usable()
            rows = self._docs.rows_for_ids(list(ids), self._gen)
            recs = self._docs.fetch(rows.values(), self._gen)
            return [Document(i, recs[rows[i]][1] or "", recs[rows[i]][2]) if i in rows else None for i in ids]

    def get_embeddings(self, ids: list[str]) -> np.ndarray:
        """Stored full-dimension embeddings (float32, in ``ids`` order); NotFoundError if one is absent."""
        with self._lock.read():
            self._check_usable()
            rows = self._docs.rows_for_ids(list(ids), self._gen)
            missing = [i for i in ids if i not in rows]
            if missing:
                raise NotFoundError(f"{len(missing)} ids not in the index, e.g. {missing[0]!r}",
                                    "check the ids (deleted documents have no embeddings)")
            return self._store.gather(np.array([rows[i] for i in ids], dtype=np.int64))

    def sample_embeddings(self, n: int, seed: int = 0) -> np.ndarray:
        """``n`` stored embeddings of random live documents (with repeats), float32."""
        with self._lock.read():
            self._check_usable()
            rows = self._docs.live_rows(self._gen)
            if len(rows) == 0:
                return np.zeros((0, self.full_dim), np.float32)
            pick = np.random.default_rng(seed).integers(0, len(rows), n)
            return self._store.gather(rows[pick])

    def export_embeddings(self) -> tuple[list[str], np.ndarray]:
        """(ids, float16 (count, full_dim)) of every live document, in row order (for tuning)."""
        with self._lock.read():
            self._check_usable()
            rows = self._docs.live_rows(self._gen)
            recs = self._docs.fetch(rows.tolist(), self._gen, with_text=False)
            return [recs[int(r)][0] for r in rows], self._store.gather16(rows)

    # ------------------------------------------------------------------ changes
    def add(self, docs: list[Document], embeddings: np.ndarray) -> int:
        """Add new documents; :class:`ConflictError` if an id is already present. Returns the count."""
        return self._put(docs, embeddings, replace=False)

    def upsert(self, docs: list[Document], embeddings: np.ndarray) -> int:
        """Add documents, replacing those whose id is present. Returns the number written."""
        return self._put(docs, embeddings, replace=True)

    def _put(self, docs: list[Document], embeddings: np.ndarray, replace: bool) -> int:
        docs = list(docs)
        check_documents(docs)
        if not docs:
            return 0
        x = normalize_rows(embeddings, self.full_dim)
        if len(x) != len(docs):
            raise InvalidInputError(f"{len(docs)} documents but {len(x)} embeddings", "pass one embedding per document")
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
        for i in ids:
            if not isinstance(i, str):
                raise InvalidInputError(f"ids must be strings, got {type(i).__name__}", "pass external ids as str")
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

    def reindex(self, config: IndexConfig, progress: bool = False) -> None:
        """Rebuild FAISS with other options from the stored embeddings (no re-embedding).

        The new FAISS index is built while searches go on; only the swap blocks them. When
        only search-time options (nprobe, ef_search, rescore, oversample, use_gpu) change,
        the manifest is updated and FAISS kept.
        """
        with self._lock.read():
            self._check_writable()
            new = self._merge_config(config)
            shape_changed = any(getattr(new, f) != getattr(self._config, f) for f in _SHAPE_FIELDS)
            prebuilt = self._prebuild(new, progress) if shape_changed else None
        with self._lock.write():
            self._check_writable()
            self._commit(config=new, rebuild=shape_changed, snapshot=shape_changed, prebuilt=prebuilt)

    def _prebuild(self, config: IndexConfig, progress: bool = False) -> tuple[int, faiss.Index, dict[str, Any]]:
        """A FAISS index of the live rows, built under the read lock; valid for this generation."""
        index, plan = faiss_index.build(config, self._store, self._docs.live_rows(self._gen), progress=progress)
        return self._gen, index, plan.to_dict()

    def _merge_config(self, config: IndexConfig) -> IndexConfig:
        """Options set in ``config`` (not ``None``) override the current ones."""
        return config.merged_into(self._config).resolve(self._count, self.full_dim)

    def with_config(self, config: IndexConfig, progress: bool = False) -> "DocumentIndex":
        """An in-memory, read-only variant with other options over the same stored vectors.

        Nothing is written; used to evaluate or tune settings without re-embedding.
        """
        with self._lock.read():
            self._check_usable()
            new = self._merge_config(config)
            shape_changed = any(getattr(new, f) != getattr(self._config, f) for f in _SHAPE_FIELDS)
            live = self._docs.live_rows(self._gen)
            if shape_changed:
                index, plan = faiss_index.build(new, self._store, live, progress=progress)
                tomb = np.zeros(0, np.int64)
                faiss_rec = {**self._m["faiss"], **plan.to_dict()}
            else:
                index, tomb, faiss_rec = self._faiss, self._tombstones, self._m["faiss"]
            v = DocumentIndex()
            v.path = self.path
            v._read_only = True
            v._ephemeral = True
            v._owns_docs = False
            v._parent = self
            m = {**self._m, "config": new.index_dict(), "dim": new.dim, "faiss": faiss_rec}
            v._set_state(m=m, space=self._space, config=new, docs=self._docs, store=self._store, index=index,
                         tombstones=tomb, count=self._count, digest=self._digest)
            return v

    # ------------------------------------------------------------------ commit
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
            if not committed and _peek_generation(self.path) != gen:
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
                self._tombstones = _reconcile(index, live, self._store, self.dim)
                self._faiss = index
                self._gpu = None
                self._gpu_tried = False
                self._tomb_selector = None
                self._faiss_nbytes = None
        except Exception as e:  # noqa: BLE001 - report the first failure, refuse further use
            self._broken = f"{type(cause).__name__}: {cause}; undo failed: {e}"
            log.error("index %s: %s", self.path, self._broken)

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        """Facts for people and the server: counts, options, sizes, space, build."""
        with self._lock.read():
            self._check_usable()
            m = self._m
            n = max(self._count, 1)
            if self._faiss_nbytes is None:
                self._faiss_nbytes = faiss_index.nbytes(self._faiss)  # serialises: once per generation
            faiss_bytes = self._faiss_nbytes
            emb_bytes = sum(c.rows for c in self._store.chunks) * self.full_dim * np.dtype(DTYPE).itemsize
            docs_bytes = self._docs.path.stat().st_size if self._docs.path.exists() else 0
            return {
                "path": str(self.path),
                "generation": self._gen,
                "documents": self._count,
                "rows": self._store.rows_total,
                "faiss_vectors": int(self._faiss.ntotal),
                "tombstones": int(len(self._tombstones)),
                "changes_since_snapshot": self._delta,
                "space": {"name": self._space.name, "fingerprint": self._space.fingerprint,
                          "dim": self.full_dim},
                "metric": m["metric"],
                "dim": self.dim,
                "full_dim": self.full_dim,
                "config": self._config.index_dict(),
                "faiss": {k: m["faiss"].get(k) for k in ("factory", "nlist", "pq_nbits", "file")},
                "rescoring": self._rescoring,
                "gpu": self._gpu is not None,
                "bytes": {"faiss": faiss_bytes, "embeddings": emb_bytes, "docstore": docs_bytes},
                "bytes_per_doc": {"faiss": faiss_bytes / n, "embeddings": emb_bytes / n, "docstore": docs_bytes / n},
                "build": m.get("build", {}),
                "created_at": m.get("created_at"),
                "updated_at": m.get("updated_at"),
                "qswap_version": m.get("qswap_version"),
                "read_only": self._read_only,
            }

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the writer lock and the document store (in-flight searches finish first)."""
        with self._lock.write():
            if self._closed:
                return
            self._closed = True
            if self._owns_docs:
                self._docs.close()
            release_lock(self._lock_fd)
            self._lock_fd = None
            self._gpu = None

    def __del__(self) -> None:
        # A forgotten close() must not keep the writer lock for the life of the process.
        try:
            if not self._closed and getattr(self, "_lock_fd", None) is not None:
                self.close()
        except Exception:  # noqa: BLE001 - best effort at garbage collection / shutdown
            pass

    def __enter__(self) -> "DocumentIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DocumentIndex({str(getattr(self, 'path', '?'))!r}, documents={getattr(self, '_count', '?')}, "
                f"kind={self._config.kind if hasattr(self, '_config') else '?'})")


# ---------------------------------------------------------------------- helpers
def _as_queries(queries: Any, full_dim: int) -> np.ndarray:
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != full_dim:
        raise InvalidInputError(f"queries have shape {q.shape}, expected (n, {full_dim})",
                                "encode queries with an encoder of the index's embedding space")
    if len(q) == 0:
        return q
    return normalize_rows(q, full_dim, "queries")


def _reconcile(index: faiss.Index, live: np.ndarray, store: EmbeddingStore, dim: int) -> np.ndarray:
    """Bring a FAISS snapshot up to the live rows; returns tombstones (rows it cannot remove)."""
    have = np.unique(faiss_index.ids_of(index))
    to_add = np.setdiff1d(live, have, assume_unique=True)
    extra = np.setdiff1d(have, live, assume_unique=True)
    for r, x in store.iter_rows(to_add):
        faiss_index.add(index, r, x, dim)
    if len(extra):
        if faiss_index.can_remove(index):
            faiss_index.remove(index, extra)
            return np.zeros(0, np.int64)
        return extra
    return np.zeros(0, np.int64)


def _peek_generation(path: Path) -> int | None:
    try:
        return int(json.loads((path / MANIFEST).read_text())["generation"])
    except Exception:  # noqa: BLE001 - any unreadable manifest just means "unknown"
        return None


def _remove_orphans(path: Path, m: dict[str, Any]) -> None:
    """Delete files an interrupted commit wrote but no manifest lists."""
    listed = set(m["files"])
    for sub in (EMB_DIR, FAISS_DIR):
        folder = path / sub
        remove_stale_temps(folder)
        if folder.is_dir():
            for p in folder.iterdir():
                if p.is_file() and f"{sub}/{p.name}" not in listed:
                    p.unlink(missing_ok=True)
    remove_stale_temps(path)
