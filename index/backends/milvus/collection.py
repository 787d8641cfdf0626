"""The Milvus backend: a qswap index kept in a Milvus collection (milvus-lite file or server).

A collection holds one row per document: ``id`` (external id, primary key), ``vec`` (the
Matryoshka prefix of ``dim`` dimensions, renormalised, indexed), ``full`` (the full vector,
only when ``dim`` is below the model's dimension and rescoring is on: a second vector field, or a
FLOAT array on servers with one vector field per collection), ``text``, ``meta`` (JSON) and
``tags`` (typed metadata for filters). qswap's manifest (embedding space and fingerprint, options, build facts) is a
collection property, checked on every open exactly like a FAISS folder's manifest.

Options map to Milvus index types (:func:`milvus_index`): flat -> FLAT; ivf -> IVF_FLAT /
IVF_SQ8 / IVF_PQ; hnsw -> HNSW / HNSW_SQ / HNSW_PQ. With rescoring on, ``k * oversample``
candidates come back with their full vectors and are re-ranked by exact cosine here.

Metadata equality filters and id lists become Milvus boolean expressions built by
:mod:`qswap.index.backends.milvus.expr` (the injection defence, alone in its module).

Locations: ``milvus://PATH.db?collection=NAME`` (milvus-lite, a local file) or
``milvus://HOST:PORT?collection=NAME`` (a Milvus server; ``milvus+https://`` for TLS); a token
for an authenticated server is read from ``QSWAP_MILVUS_TOKEN``. Connections, deadlines and how
failures map (an unreachable server is a 503 ``index_unavailable``) are in
:mod:`~qswap.index.backends.milvus.connection`; building in :mod:`~qswap.index.backends.milvus.build`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from qswap.errors import ConflictError, InvalidInputError, NotFoundError, QswapError
from qswap.index.config import IndexConfig
from qswap.index.corpus import Document, check_documents
from qswap.index.checks import as_queries, check_ids, normalize_rows
from qswap.index.backends.common import BackendCommon
from qswap.index.backends.milvus.connection import (BUILD_TIMEOUT_S, Connection, connect, milvus_error,
                                                    parse_location)
from qswap.index.backends.milvus.expr import filter_expr, ids_expr, tags
from qswap.matryoshka import truncate
from qswap.index.errors import IndexCorruptError
from qswap.index.hit import FilterValue, Hit
from qswap.space import EmbeddingSpace

log = logging.getLogger("qswap.index")

FORMAT = "qswap-milvus"
FORMAT_VERSION = 1
MANIFEST_PROPERTY = "qswap.manifest"
MAX_ID_CHARS = 512
MAX_TEXT_CHARS = 65_535          # Milvus VARCHAR limit (bytes): longer texts are refused
_INSERT_BATCH = 512
_ID_BATCH = 500
# Milvus caps topk (and offset + limit) at 16384.
MAX_FETCH = 16_384


# ---------------------------------------------------------------------- index types
def milvus_index(cfg: IndexConfig) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(index type, build params, search params) for resolved qswap options.

    Milvus has no 4-bit scalar quantiser for IVF: ``sq4`` maps to IVF_SQ8 (HNSW_SQ's SQ6 for hnsw).
    """
    q, kind = cfg.quant, cfg.kind
    if kind == "flat":
        return "FLAT", {}, {}
    if kind == "ivf":
        t = {"fp32": "IVF_FLAT", "fp16": "IVF_FLAT", "sq8": "IVF_SQ8", "sq4": "IVF_SQ8", "pq": "IVF_PQ"}[q]
        params: dict[str, Any] = {"nlist": int(cfg.nlist)}
        if t == "IVF_PQ":
            params.update(m=int(cfg.pq_m), nbits=8)
        return t, params, {"nprobe": int(cfg.nprobe)}
    params = {"M": int(cfg.hnsw_m), "efConstruction": int(cfg.ef_construction)}
    if q in ("fp32", "fp16"):
        t = "HNSW"
    elif q == "pq":
        t = "HNSW_PQ"
        params.update(m=int(cfg.pq_m), nbits=8)
    else:
        t = "HNSW_SQ"
        params["sq_type"] = "SQ8" if q == "sq8" else "SQ6"
    return t, params, {"ef": int(cfg.ef_search)}


def _rescoring(cfg: IndexConfig, full_dim: int) -> bool:
    """Whether a search re-ranks candidates by exact cosine over the full vectors. Not when Milvus
    already scores the full float32 vectors (full dimension, fp32/fp16 kept as float32): its scores
    are the exact ones, and fetching ``k × oversample`` vectors and texts to re-rank them the same
    way cost more than the search itself (bench/results/index/milvus-server)."""
    return bool(cfg.rescore) and not (cfg.dim == full_dim and cfg.quant in ("fp32", "fp16"))


# ---------------------------------------------------------------------- the index
class MilvusIndex(BackendCommon):
    """A qswap index in a Milvus collection (see the module doc)."""

    def __init__(self, conn: Connection, collection: str, manifest: dict[str, Any], read_only: bool) -> None:
        self._conn = conn
        self.uri = conn.uri
        self.collection = collection
        self._m = manifest
        self._space = EmbeddingSpace.from_dict(manifest["space"])
        self._config = IndexConfig.from_dict(manifest["config"])
        self._read_only = read_only
        self._closed = False
        self._write_lock = threading.Lock()
        self._count: int | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def open_location(cls, location: str, *, read_only: bool = False,
                      expected_space: EmbeddingSpace | None = None) -> "MilvusIndex":
        uri, collection = parse_location(location)
        return cls.open(uri, collection, read_only=read_only, expected_space=expected_space)

    @classmethod
    def open(cls, uri: str, collection: str, *, read_only: bool = False,
             expected_space: EmbeddingSpace | None = None) -> "MilvusIndex":
        """Open a collection built by qswap, checking its manifest and embedding space."""
        c = connect(uri)
        try:
            if not c.call("has_collection", "a collection check", collection):
                raise NotFoundError(f"Milvus at {uri.split('@')[-1]} has no collection {collection!r}",
                                    "build it with `qswap index build CORPUS --backend milvus --uri URI "
                                    "--collection NAME`")
            m = read_manifest(c, collection)
            space = EmbeddingSpace.from_dict(m["space"])
            if space.fingerprint != m.get("fingerprint"):
                raise IndexCorruptError(f"collection {collection!r}: manifest fingerprint does not match its space",
                                        "rebuild the collection with qswap")
            if expected_space is not None:
                expected_space.require_same(space, f"collection {collection!r}")
            c.call("load_collection", "loading the collection", collection, timeout_s=BUILD_TIMEOUT_S)
            return cls(c, collection, m, read_only)
        except BaseException:
            c.close()
            raise

    # ------------------------------------------------------------------ properties
    @property
    def manifest(self) -> dict[str, Any]:
        return dict(self._m)

    @property
    def count(self) -> int:
        if self._count is None:
            self._count = self._query_count()
        return self._count

    def _query_count(self) -> int:
        r = self._conn.call_loaded(self.collection, "query", "a count", self.collection, filter="",
                                   output_fields=["count(*)"])
        return int(r[0]["count(*)"])

    @property
    def _full_field(self) -> str:
        return "full" if self.dim < self.full_dim else "vec"

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidInputError("the index is closed", "open it again")

    def _check_writable(self) -> None:
        self._check_usable()
        if self._read_only:
            raise InvalidInputError(f"collection {self.collection!r} was opened read-only",
                                    "open it without read_only to change it")

    # ------------------------------------------------------------------ search
    def search(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
               with_text: bool = True) -> list[list[Hit]]:
        """Top-``k`` documents per query row (full-dimension, L2-normalised), filtered by metadata."""
        q = as_queries(queries, self.full_dim)
        k = _check_k(k)
        expr = filter_expr(filter)
        self._check_usable()
        if len(q) == 0:
            return []
        cfg = self._config
        rescore = _rescoring(cfg, self.full_dim)
        fetch = min(k * int(cfg.oversample or 1) if rescore else k, MAX_FETCH)
        _, _, sp = milvus_index(cfg)
        if "ef" in sp:
            sp = {"ef": max(sp["ef"], fetch)}
        fields = ["meta"] + (["text"] if with_text else []) + ([self._full_field] if rescore else [])
        res = self._conn.call_loaded(self.collection, "search", "a search", self.collection,
                                     truncate(q, self.dim).tolist(), anns_field="vec", limit=fetch, filter=expr,
                                     output_fields=fields, search_params={"params": sp})
        out = []
        for j, hits in enumerate(res):
            rows = list(hits)
            if rescore and rows:
                full = np.asarray([h["entity"][self._full_field] for h in rows], dtype=np.float32)
                scores = full @ q[j]
            else:
                scores = np.asarray([h["distance"] for h in rows], dtype=np.float32)
            ids = [h["entity"].get("id", h.get("id")) for h in rows]
            order = sorted(range(len(rows)), key=lambda n: (-float(scores[n]), ids[n]))[:k]
            out.append([Hit(str(ids[n]), float(scores[n]), rows[n]["entity"].get("text") if with_text else None,
                            dict(rows[n]["entity"].get("meta") or {})) for n in order])
        return out

    def search_exact(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
                     with_text: bool = False) -> list[list[Hit]]:
        """Brute-force top-``k`` by exact cosine over every (filtered) document's full vector."""
        q = as_queries(queries, self.full_dim)
        k = _check_k(k)
        expr = filter_expr(filter)
        self._check_usable()
        ids, vecs, recs = [], [], []
        fields = ["id", self._full_field, "meta"] + (["text"] if with_text else [])
        for batch in self._iterate(expr, fields):
            for r in batch:
                ids.append(r["id"])
                vecs.append(r[self._full_field])
                recs.append(r)
        if not ids:
            return [[] for _ in range(len(q))]
        s = q @ np.asarray(vecs, dtype=np.float32).T
        out = []
        for j in range(len(q)):
            order = sorted(range(len(ids)), key=lambda n: (-float(s[j, n]), ids[n]))[:k]
            out.append([Hit(ids[n], float(s[j, n]), recs[n].get("text") if with_text else None,
                            dict(recs[n].get("meta") or {})) for n in order])
        return out

    def _iterate(self, expr: str, fields: list[str], batch: int = 1000) -> Iterable[list[dict[str, Any]]]:
        try:
            it = self._conn.call_loaded(self.collection, "query_iterator", "a scan", self.collection,
                                        batch_size=batch, filter=expr, output_fields=fields)
            while True:
                part = it.next()
                if not part:
                    it.close()
                    return
                yield list(part)
        except QswapError:
            raise
        except Exception as e:  # noqa: BLE001
            raise milvus_error(e, "a scan", self.uri) from None

    # ------------------------------------------------------------------ reads by id
    def _fetch(self, ids: list[str], fields: list[str]) -> dict[str, dict[str, Any]]:
        check_ids(ids)
        self._check_usable()
        out: dict[str, dict[str, Any]] = {}
        uniq = sorted(set(ids))
        for i in range(0, len(uniq), _ID_BATCH):
            part = uniq[i:i + _ID_BATCH]
            rows = self._conn.call_loaded(self.collection, "query", "a read by id", self.collection,
                                          filter=ids_expr(part), output_fields=fields)
            out.update({r["id"]: r for r in rows})
        return out

    def get(self, ids: list[str]) -> list[Document | None]:
        recs = self._fetch(list(ids), ["id", "text", "meta"])
        return [Document(i, recs[i]["text"], dict(recs[i]["meta"] or {})) if i in recs else None for i in ids]

    def get_embeddings(self, ids: list[str]) -> np.ndarray:
        recs = self._fetch(list(ids), ["id", self._full_field])
        missing = [i for i in ids if i not in recs]
        if missing:
            raise NotFoundError(f"{len(missing)} ids not in the index, e.g. {missing[0]!r}",
                                "check the ids (deleted documents have no embeddings)")
        return np.asarray([recs[i][self._full_field] for i in ids], dtype=np.float32).reshape(len(ids), -1)

    def export_embeddings(self) -> tuple[list[str], np.ndarray]:
        ids, vecs = [], []
        for batch in self._iterate("", ["id", self._full_field]):
            for r in batch:
                ids.append(r["id"])
                vecs.append(r[self._full_field])
        return ids, np.asarray(vecs, dtype=np.float16).reshape(len(ids), self.full_dim)

    # ------------------------------------------------------------------ changes
    def _put(self, docs: list[Document], embeddings: np.ndarray, replace: bool) -> int:
        docs = list(docs)
        check_documents(docs)
        if not docs:
            return 0
        _check_sizes(docs)
        x = normalize_rows(embeddings, self.full_dim)
        if len(x) != len(docs):
            raise InvalidInputError(f"{len(docs)} documents but {len(x)} embeddings", "pass one embedding per document")
        with self._write_lock:
            self._check_writable()
            if not replace:
                present = self._fetch([d.id for d in docs], ["id"])
                if present:
                    some = ", ".join(repr(i) for i in list(present)[:5])
                    raise ConflictError(f"{len(present)} ids already in the index: {some}",
                                        "use upsert to replace them, or delete them first")
            rows = _rows(docs, x, self.dim, self.full_dim, self._has_full)
            self._count = None
            for i in range(0, len(rows), _INSERT_BATCH):
                self._conn.call("upsert", "an upsert", self.collection, rows[i:i + _INSERT_BATCH])
        return len(docs)

    @property
    def _has_full(self) -> bool:
        return bool(self._m.get("full_vectors"))

    def delete(self, ids: list[str]) -> int:
        """Delete documents by external id; absent ids are ignored. Returns how many were deleted."""
        ids = list(ids)
        check_ids(ids)
        with self._write_lock:
            self._check_writable()
            present = sorted(self._fetch(ids, ["id"]))
            if not present:
                return 0
            self._count = None
            for i in range(0, len(present), _ID_BATCH):
                self._conn.call("delete", "a delete", self.collection, filter=ids_expr(present[i:i + _ID_BATCH]))
        return len(present)

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        self._check_usable()
        t, params, sp = milvus_index(self._config)
        n = max(self.count, 1)
        local = Path(self.uri) if self.uri.endswith(".db") else None
        size = _path_bytes(local) if local is not None else None
        return {
            "backend": "milvus",
            "uri": self.uri if local is not None else self.uri.split("@")[-1],
            "collection": self.collection,
            "documents": self.count,
            "space": {"name": self._space.name, "fingerprint": self._space.fingerprint, "dim": self.full_dim},
            "metric": "inner_product",
            "dim": self.dim,
            "full_dim": self.full_dim,
            "config": self._config.index_dict(),
            "milvus": {"index_type": t, "params": params, "search_params": sp,
                       "full_vectors": self._has_full, "full_vectors_field": self._m.get("full_field", "vector"),
                       "server": self._conn.features.to_dict(), "read_consistency": self._conn.consistency},
            "rescoring": _rescoring(self._config, self.full_dim),
            "bytes": {"milvus_lite_file": size} if size is not None else {},
            "bytes_per_doc": {"milvus_lite_file": size / n} if size is not None else {},
            "build": self._m.get("build", {}),
            "created_at": self._m.get("created_at"),
            "qswap_version": self._m.get("qswap_version"),
            "read_only": self._read_only,
        }

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn.close()

    def __enter__(self) -> "MilvusIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MilvusIndex({self.uri!r}, collection={self.collection!r})"


# ---------------------------------------------------------------------- manifest
def read_manifest(conn: Connection, collection: str) -> dict[str, Any]:
    """The qswap manifest kept in ``collection``'s properties, checked."""
    props = conn.call("describe_collection", "describe_collection", collection).get("properties", {})
    raw = props.get(MANIFEST_PROPERTY)
    if raw is None:
        raise IndexCorruptError(f"collection {collection!r} has no qswap manifest",
                                "build the collection with `qswap index build --backend milvus`")
    try:
        m = json.loads(raw)
        if m.get("format") != FORMAT or int(m.get("format_version", 0)) > FORMAT_VERSION:
            raise ValueError(f"format {m.get('format')!r} version {m.get('format_version')!r}")
        EmbeddingSpace.from_dict(m["space"])
        IndexConfig.from_dict(m["config"])
    except (ValueError, KeyError, TypeError, InvalidInputError) as e:
        raise IndexCorruptError(f"collection {collection!r}: the qswap manifest is malformed ({e})",
                                "rebuild the collection with qswap") from None
    return m


def _rows(docs: list[Document], x: np.ndarray, dim: int, full_dim: int, full: bool) -> list[dict[str, Any]]:
    pre = truncate(x, dim) if dim < full_dim else np.asarray(x, dtype=np.float32)
    rows = []
    for n, d in enumerate(docs):
        r = {"id": d.id, "vec": pre[n].tolist(), "text": d.text, "meta": d.metadata, "tags": tags(d.metadata)}
        if full:
            r["full"] = np.asarray(x[n], dtype=np.float32).tolist()
        rows.append(r)
    return rows


def _check_sizes(docs: list[Document]) -> None:
    for d in docs:
        if len(d.id.encode("utf-8")) > MAX_ID_CHARS:
            raise InvalidInputError(f"document id {d.id[:40]!r}... is over {MAX_ID_CHARS} bytes",
                                    "the Milvus backend keeps ids as VARCHAR(512); shorten the id")
        if len(d.text.encode("utf-8")) > MAX_TEXT_CHARS:
            raise InvalidInputError(f"document {d.id!r}: text is over {MAX_TEXT_CHARS} bytes",
                                    "Milvus VARCHAR holds at most 65,535 bytes; split the document")


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InvalidInputError(f"k must be a positive integer, got {k!r}", "ask for at least one result")
    return int(k)


def _path_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return 0
