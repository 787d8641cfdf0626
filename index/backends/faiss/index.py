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

Thread safety: changes take the change lock one at a time and write their generation while
searches go on; searches share a read lock that a change takes for writing only to swap the
new generation in (:mod:`qswap.index.backends.faiss.commit`). A batch of queries is one
batched FAISS call.

The class is split by concern: opening, verifying and state here; search in
:mod:`qswap.index.backends.faiss.search`; the commit/undo engine in :mod:`qswap.index.backends.faiss.commit`; re-indexing in
:mod:`qswap.index.backends.faiss.reindex`; manifest building in :mod:`qswap.index.backends.faiss.generation`; locks and
recovery in :mod:`qswap.index.backends.faiss.recovery`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import faiss
import numpy as np

import qswap.index.backends.faiss.faiss_index as faiss_index
from qswap.atomic import recover_dir
from qswap.errors import InvalidInputError, NotFoundError, QswapError
from qswap.index.backends.common import BackendCommon
from qswap.index.backends.faiss.commit import CommitMixin
from qswap.index.config import IndexConfig
from qswap.index.corpus import Document
from qswap.index.backends.faiss.docstore import DOCS_FILE, DocStore
from qswap.index.backends.faiss.embeddings import DTYPE, Chunk, EmbeddingStore
from qswap.index.errors import IndexCorruptError
from qswap.index.manifest import MANIFEST, read_manifest, verify_files
from qswap.index.backends.faiss.recovery import acquire_writer_lock, peek_generation, reconcile, release_lock, remove_orphans
from qswap.index.backends.faiss.reindex import ReindexMixin
from qswap.index.backends.faiss.rwlock import RWLock
from qswap.index.backends.faiss.search import SearchMixin
from qswap.space import EmbeddingSpace

log = logging.getLogger("qswap.index")


class DocumentIndex(BackendCommon, SearchMixin, CommitMixin, ReindexMixin):
    """A FAISS document index with its float16 embedding log and SQLite document store."""

    # Thresholds (SNAPSHOT_*, TOMBSTONE_*, EXACT_FILTER_MAX) live with the code that uses them
    # (CommitMixin, SearchMixin); set them on this class to tune one process.

    def __init__(self) -> None:  # use open(), build_index() or create_index()
        self._lock = RWLock()            # searches share it; a commit holds it only to swap generations
        self._change_lock = threading.Lock()   # one change at a time, held for a whole commit
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
            gen_before = peek_generation(path)
            try:
                return cls._open_once(path, read_only, expected_space, verify)
            except IndexCorruptError as e:
                # A writer in another process may have committed (and removed old files)
                # while we read: try again on the new generation.
                last = e
                if not read_only or peek_generation(path) == gen_before:
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
                remove_orphans(path, m)
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
            tombstones = reconcile(index, live, store, config.dim)
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
    def count(self) -> int:
        """Number of live documents."""
        return self._count

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def manifest(self) -> dict[str, Any]:
        return dict(self._m)

    @property
    def _described(self) -> str:
        return f"index {self.path}"

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
        self._refuse_read_only()

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
                "backend": "faiss",
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
    @contextmanager
    def _closing(self) -> Iterator[None]:
        with self._change_lock, self._lock.write():   # a running change and in-flight searches finish first
            yield

    def _release(self) -> None:
        """The writer lock and the document store."""
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

    def __repr__(self) -> str:
        return (f"DocumentIndex({str(getattr(self, 'path', '?'))!r}, documents={getattr(self, '_count', '?')}, "
                f"kind={self._config.kind if hasattr(self, '_config') else '?'})")
