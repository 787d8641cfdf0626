"""The Milvus backend: a qswap index kept in a Milvus collection (milvus-lite file or server).

A collection holds one row per document: ``id`` (external id, primary key), ``vec`` (the
Matryoshka prefix of ``dim`` dimensions, renormalised, indexed), ``full`` (the full vector,
only when ``dim`` is below the model's dimension and rescoring is on), ``text`` and ``meta``
(JSON). qswap's manifest (embedding space and fingerprint, options, build facts) is a
collection property, checked on every open exactly like a FAISS folder's manifest.

Options map to Milvus index types (:func:`milvus_index`): flat -> FLAT; ivf -> IVF_FLAT /
IVF_SQ8 / IVF_PQ; hnsw -> HNSW / HNSW_SQ / HNSW_PQ. With rescoring on, ``k * oversample``
candidates come back with their full vectors and are re-ranked by exact cosine here.

Metadata equality filters and id lists become Milvus boolean expressions built by
:mod:`qswap.index.backends.milvus.expr` (the injection defence, alone in its module).

Locations: ``milvus://PATH.db?collection=NAME`` (milvus-lite, a local file) or
``milvus://HOST:PORT?collection=NAME`` (a Milvus server; ``milvus+https://`` for TLS); a token
for an authenticated server is read from ``QSWAP_MILVUS_TOKEN``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import numpy as np

import qswap
from qswap.errors import ConflictError, InvalidInputError, NotFoundError, QswapError
from qswap.index.config import IndexConfig
from qswap.index.corpus import BadLine, Document, check_documents, iter_corpus
from qswap.index.checks import as_queries, check_ids, normalize_rows
from qswap.index.backends.common import BackendCommon
from qswap.index.backends.milvus.expr import filter_expr, ids_expr, tags
from qswap.matryoshka import truncate
from qswap.index.errors import IndexCorruptError
from qswap.index.hit import FilterValue, Hit
from qswap.index.manifest import now_iso
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

Embed = Callable[[list[str]], np.ndarray]


# ---------------------------------------------------------------------- locations
def parse_location(location: str) -> tuple[str, str]:
    """``milvus://...?collection=NAME`` -> (pymilvus URI, collection name)."""
    scheme = "http://"
    rest = location
    for prefix, sch in (("milvus+https://", "https://"), ("milvus://", "http://")):
        if rest.startswith(prefix):
            rest, scheme = rest[len(prefix):], sch
            break
    else:
        raise InvalidInputError(f"{location!r} is not a milvus:// location",
                                "write milvus://PATH.db?collection=NAME or milvus://HOST:PORT?collection=NAME")
    where, _, query = rest.partition("?")
    names = parse_qs(query).get("collection", [])
    if not where or len(names) != 1 or not names[0]:
        raise InvalidInputError(f"{location!r} names no collection",
                                "write milvus://PATH.db?collection=NAME or milvus://HOST:PORT?collection=NAME")
    uri = where if where.endswith(".db") else scheme + where
    return uri, names[0]


def _client(uri: str) -> Any:
    try:
        from pymilvus import MilvusClient
    except ImportError:
        raise InvalidInputError("the Milvus backend needs pymilvus", "pip install 'qswap[milvus]'") from None
    if uri.endswith(".db"):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    try:
        return MilvusClient(uri=uri, token=os.environ.get("QSWAP_MILVUS_TOKEN", ""))
    except Exception as e:  # noqa: BLE001 - pymilvus raises several unrelated types when it cannot connect
        raise NotFoundError(f"cannot connect to Milvus at {uri} ({type(e).__name__}: {str(e)[:200]})",
                            "check the URI (a .db path for milvus-lite, http://host:19530 for a server)") from None


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
    return bool(cfg.rescore) and not (cfg.is_exact and cfg.dim == full_dim)


# pymilvus' names for "this row does not fit the schema": the caller's data, not a damaged index.
_INPUT_ERRORS = ("DataNotMatchException", "ParamError", "DataTypeNotSupportException")


def _milvus_error(e: Exception, what: str) -> QswapError:
    if type(e).__name__ in _INPUT_ERRORS:
        return InvalidInputError(f"Milvus refused the data of {what} ({str(e)[:300]})",
                                 "metadata must be JSON with 64-bit integers; see the request schema")
    return IndexCorruptError(f"Milvus refused {what} ({type(e).__name__}: {str(e)[:300]})",
                             "check that the Milvus server is up and the collection is loaded")


# ---------------------------------------------------------------------- the index
class MilvusIndex(BackendCommon):
    """A qswap index in a Milvus collection (see the module doc)."""

    def __init__(self, client: Any, uri: str, collection: str, manifest: dict[str, Any], read_only: bool) -> None:
        self._c = client
        self.uri = uri
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
        c = _client(uri)
        if not c.has_collection(collection):
            c.close()
            raise NotFoundError(f"Milvus at {uri} has no collection {collection!r}",
                                "build it with `qswap index build CORPUS --backend milvus --uri URI "
                                "--collection NAME`")
        try:
            m = read_manifest(c, collection)
            space = EmbeddingSpace.from_dict(m["space"])
            if space.fingerprint != m.get("fingerprint"):
                raise IndexCorruptError(f"collection {collection!r}: manifest fingerprint does not match its space",
                                        "rebuild the collection with qswap")
            if expected_space is not None:
                expected_space.require_same(space, f"collection {collection!r}")
            c.load_collection(collection)
            return cls(c, uri, collection, m, read_only)
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
        try:
            r = self._c.query(self.collection, filter="", output_fields=["count(*)"])
        except Exception as e:  # noqa: BLE001
            raise _milvus_error(e, "a count") from None
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
        try:
            res = self._c.search(self.collection, truncate(q, self.dim).tolist(), anns_field="vec",
                                 limit=fetch, filter=expr, output_fields=fields, search_params={"params": sp})
        except Exception as e:  # noqa: BLE001
            raise _milvus_error(e, "a search") from None
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
            it = self._c.query_iterator(self.collection, batch_size=batch, filter=expr, output_fields=fields)
            while True:
                part = it.next()
                if not part:
                    it.close()
                    return
                yield list(part)
        except QswapError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _milvus_error(e, "a scan") from None

    # ------------------------------------------------------------------ reads by id
    def _fetch(self, ids: list[str], fields: list[str]) -> dict[str, dict[str, Any]]:
        check_ids(ids)
        self._check_usable()
        out: dict[str, dict[str, Any]] = {}
        uniq = sorted(set(ids))
        for i in range(0, len(uniq), _ID_BATCH):
            part = uniq[i:i + _ID_BATCH]
            try:
                rows = self._c.query(self.collection, filter=ids_expr(part), output_fields=fields)
            except Exception as e:  # noqa: BLE001
                raise _milvus_error(e, "a read by id") from None
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
            try:
                for i in range(0, len(rows), _INSERT_BATCH):
                    self._c.upsert(self.collection, rows[i:i + _INSERT_BATCH])
            except Exception as e:  # noqa: BLE001
                raise _milvus_error(e, "an upsert") from None
            self._count = None
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
            try:
                for i in range(0, len(present), _ID_BATCH):
                    self._c.delete(self.collection, filter=ids_expr(present[i:i + _ID_BATCH]))
            except Exception as e:  # noqa: BLE001
                raise _milvus_error(e, "a delete") from None
            self._count = None
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
                       "full_vectors": self._has_full},
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
        try:
            self._c.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error
            pass

    def __enter__(self) -> "MilvusIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MilvusIndex({self.uri!r}, collection={self.collection!r})"


# ---------------------------------------------------------------------- manifest
def read_manifest(client: Any, collection: str) -> dict[str, Any]:
    try:
        props = client.describe_collection(collection).get("properties", {})
    except Exception as e:  # noqa: BLE001
        raise _milvus_error(e, "describe_collection") from None
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


def _manifest(space: EmbeddingSpace, cfg: IndexConfig, full: bool, build: dict[str, Any]) -> dict[str, Any]:
    t, params, _ = milvus_index(cfg)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "qswap_version": qswap.__version__,
            "created_at": now_iso(), "space": space.to_dict(), "fingerprint": space.fingerprint,
            "metric": "inner_product", "normalized": True, "full_dim": space.dim, "dim": cfg.dim,
            "config": cfg.index_dict(), "full_vectors": full, "index_type": t, "index_params": params,
            "build": build}


# ---------------------------------------------------------------------- building
def create_collection(uri: str, collection: str, docs: list[Document], embeddings: np.ndarray,
                      space: EmbeddingSpace, config: IndexConfig | None = None, *, replace: bool = False,
                      build: dict[str, Any] | None = None) -> MilvusIndex:
    """A new collection from documents and their embeddings (the Milvus twin of ``create_index``)."""
    docs = list(docs)
    check_documents(docs)
    if not docs:
        raise InvalidInputError("no documents to index", "pass at least one document")
    x = normalize_rows(embeddings, space.dim)
    if len(x) != len(docs):
        raise InvalidInputError(f"{len(docs)} documents but {len(x)} embeddings", "pass one embedding per document")

    def batches() -> Iterable[tuple[list[Document], np.ndarray]]:
        for i in range(0, len(docs), _INSERT_BATCH):
            yield docs[i:i + _INSERT_BATCH], x[i:i + _INSERT_BATCH]

    return _build(uri, collection, len(docs), batches(), space, config or IndexConfig(), replace=replace,
                  build={"documents": len(docs), **(build or {})})


def build_collection(corpus_path: Path, uri: str, collection: str, embed: Embed, space: EmbeddingSpace,
                     config: IndexConfig | None = None, on_bad_line: str = "stop", progress: bool = True, *,
                     format: str = "auto", model: str | None = None, replace: bool = False,
                     embedding: dict[str, Any] | None = None) -> MilvusIndex:
    """Embed a JSONL/BEIR corpus into a new Milvus collection (bad lines stop or are skipped).

    ``embedding``: how ``embed`` embeds (precision, runtime, measured quality), recorded in the
    collection's manifest.
    """
    from qswap.atomic import sha256_file
    from qswap.index.corpus import corpus_file

    config = config or IndexConfig()
    config.validate(space.dim)
    corpus = corpus_file(corpus_path)
    bad: list[BadLine] = []
    # First pass: validate every line (a bad corpus changes nothing) and count documents.
    n = sum(1 for _ in iter_corpus(corpus, format=format, on_bad_line=on_bad_line, bad_lines=bad))
    if n == 0:
        raise InvalidInputError(f"{corpus}: no documents{f' ({len(bad)} bad lines skipped)' if bad else ''}",
                                "give a JSONL file with one {\"id\", \"text\"} object per line")
    from tqdm import tqdm
    bar = tqdm(total=n, unit="doc", desc="embedding", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    bs = int(config.batch_size)

    def batches() -> Iterable[tuple[list[Document], np.ndarray]]:
        buf: list[Any] = []
        for rec in iter_corpus(corpus, format=format, on_bad_line=on_bad_line, bad_lines=[]):
            buf.append(rec)
            if len(buf) >= bs:
                yield _embed_batch(buf, embed, space.dim)
                bar.update(len(buf))
                buf = []
        if buf:
            yield _embed_batch(buf, embed, space.dim)
            bar.update(len(buf))

    build = {"corpus": str(corpus.resolve()), "corpus_sha256": sha256_file(corpus), "format": format,
             "model": model, "on_bad_line": on_bad_line, "documents": n, "n_bad_lines": len(bad),
             "bad_lines": [b.to_dict() for b in bad[:100]], "batch_size": bs}
    if embedding:
        build["embedding"] = embedding
    try:
        return _build(uri, collection, n, batches(), space, config, replace=replace, build=build)
    finally:
        bar.close()


def _embed_batch(recs: list[Any], embed: Embed, full_dim: int) -> tuple[list[Document], np.ndarray]:
    e = normalize_rows(embed([r.embed_text for r in recs]), full_dim, "embed() output")
    if len(e) != len(recs):
        raise InvalidInputError(f"embed() returned {len(e)} rows for {len(recs)} texts",
                                "the embed function must return one row per text")
    return [r.doc for r in recs], e


def _build(uri: str, collection: str, n: int, batches: Iterable[tuple[list[Document], np.ndarray]],
           space: EmbeddingSpace, config: IndexConfig, *, replace: bool, build: dict[str, Any]) -> MilvusIndex:
    """Write a collection under a staging name, index it, then put it in place of ``collection``."""
    from pymilvus import DataType, MilvusClient

    cfg = config.resolve(n, space.dim)
    full = _rescoring(cfg, space.dim) and cfg.dim < space.dim
    t0 = time.time()
    c = _client(uri)
    try:
        if c.has_collection(collection) and not replace:
            raise ConflictError(f"Milvus at {uri} already has a collection {collection!r}",
                                "pass --replace to rebuild it, or choose another --collection")
        staging = f"{collection}__qswap_building"
        if c.has_collection(staging):
            c.drop_collection(staging)
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_CHARS)
        schema.add_field("vec", DataType.FLOAT_VECTOR, dim=int(cfg.dim))
        if full:
            schema.add_field("full", DataType.FLOAT_VECTOR, dim=space.dim)
        schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_CHARS)
        schema.add_field("meta", DataType.JSON)
        schema.add_field("tags", DataType.JSON)  # typed copy of the scalar metadata, for filters
        c.create_collection(staging, schema=schema, consistency_level="Strong")
        seen = 0
        for docs, x in batches:
            _check_sizes(docs)
            rows = _rows(docs, x, int(cfg.dim), space.dim, full)
            c.insert(staging, rows)
            seen += len(rows)
        t, params, _ = milvus_index(cfg)
        ip = c.prepare_index_params()
        ip.add_index("vec", index_type=t, metric_type="IP", params=params)
        if full:
            ip.add_index("full", index_type="FLAT", metric_type="IP")
        c.create_index(staging, ip)
        build = {**build, "documents": seen, "seconds": round(time.time() - t0, 3), "started_at": t0}
        c.alter_collection_properties(staging, {MANIFEST_PROPERTY: json.dumps(_manifest(space, cfg, full, build))})
        if c.has_collection(collection):
            c.drop_collection(collection)
        c.rename_collection(staging, collection)
    except QswapError:
        c.close()
        raise
    except Exception as e:  # noqa: BLE001
        c.close()
        raise _milvus_error(e, "the build") from None
    c.close()
    return MilvusIndex.open(uri, collection)


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
