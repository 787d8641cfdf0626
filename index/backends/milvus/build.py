"""Building a Milvus collection: documents (or a corpus, embedded batch by batch) written under a
staging name, indexed, given qswap's manifest, then renamed into place (a refused corpus or a
failed build leaves the old collection as it was).

The schema follows what the server supports (:class:`~qswap.index.backends.milvus.connection.ServerFeatures`):
the full vectors that rescoring reads are a second vector field where the server allows several,
else a FLOAT array field (Milvus < 2.4); quantised HNSW is refused before anything is written
where the server has none.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

import qswap
from qswap.errors import ConflictError, InvalidInputError, QswapError
from qswap.index.backends.milvus.collection import (FORMAT, FORMAT_VERSION, MANIFEST_PROPERTY, MAX_ID_CHARS,
                                                    MAX_TEXT_CHARS, _INSERT_BATCH, MilvusIndex, _check_sizes, _rescoring, _rows,
                                                    milvus_index)
from qswap.index.backends.milvus.connection import BUILD_TIMEOUT_S, Connection, connect, milvus_error
from qswap.index.checks import documents_with_embeddings, normalize_rows
from qswap.index.config import IndexConfig
from qswap.index.corpus import BadLine, Document, iter_corpus
from qswap.index.manifest import now_iso
from qswap.space import EmbeddingSpace

Embed = Callable[[list[str]], np.ndarray]


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
    docs, x = documents_with_embeddings(docs, embeddings, space.dim)

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
    cfg = config.resolve(n, space.dim)
    full = _rescoring(cfg, space.dim) and cfg.dim < space.dim
    t0 = time.time()
    c = connect(uri)
    try:
        t, params, _ = milvus_index(cfg)
        _check_supported(c, t)
        if c.call("has_collection", "a collection check", collection) and not replace:
            raise ConflictError(f"Milvus at {uri.split('@')[-1]} already has a collection {collection!r}",
                                "pass --replace to rebuild it, or choose another --collection")
        staging = f"{collection}__qswap_building"
        if c.call("has_collection", "a collection check", staging):
            c.call("drop_collection", "dropping a stale staging collection", staging)
        full_field = ("vector" if c.features.multi_vector else "array") if full else None
        c.call("create_collection", "creating the collection", staging,
               schema=_schema(int(cfg.dim), space.dim, full_field), consistency_level="Strong")
        seen = 0
        for docs, x in batches:
            _check_sizes(docs)
            rows = _rows(docs, x, int(cfg.dim), space.dim, full)
            c.call("insert", "an insert", staging, rows, timeout_s=BUILD_TIMEOUT_S)
            seen += len(rows)
        if not c.is_lite:
            # Sealed segments before indexing: the index then covers every row, and a read that
            # does not wait for the server's time tick (Session) finds every row once loaded.
            c.call("flush", "flushing the inserted rows", staging, timeout_s=BUILD_TIMEOUT_S)
        ip = c.client.prepare_index_params()
        ip.add_index("vec", index_type=t, metric_type="IP", params=params)
        if full_field == "vector":
            ip.add_index("full", index_type="FLAT", metric_type="IP")
        c.call("create_index", "indexing", staging, ip, timeout_s=BUILD_TIMEOUT_S)
        build = {**build, "documents": seen, "seconds": round(time.time() - t0, 3), "started_at": t0,
                 "milvus_server": c.features.version}
        manifest = {**_manifest(space, cfg, full, build), **({"full_field": full_field} if full_field else {})}
        c.call("alter_collection_properties", "writing the manifest", staging,
               {MANIFEST_PROPERTY: json.dumps(manifest)})
        if c.call("has_collection", "a collection check", collection):
            c.call("drop_collection", "dropping the old collection", collection)
        c.call("rename_collection", "renaming the collection into place", staging, collection)
        c.wrote(collection)   # this process's next reads of it wait until the server has it all
    except QswapError:
        c.close()
        raise
    except Exception as e:  # noqa: BLE001
        c.close()
        raise milvus_error(e, "the build", uri) from None
    c.close()
    return MilvusIndex.open(uri, collection)


def _check_supported(c: Connection, index_type: str) -> None:
    if index_type in ("HNSW_SQ", "HNSW_PQ") and not c.features.quantized_hnsw:
        raise InvalidInputError(f"Milvus {c.features.version} has no {index_type} index (Milvus >= 2.6 has)",
                                "build with --kind hnsw --quant fp32, or --kind ivf with sq8/pq")


def _schema(dim: int, full_dim: int, full_field: str | None) -> Any:
    """The collection's fields; ``full_field``: None, "vector" (a second vector field) or "array"."""
    from pymilvus import DataType, MilvusClient
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_CHARS)
    schema.add_field("vec", DataType.FLOAT_VECTOR, dim=dim)
    if full_field == "vector":
        schema.add_field("full", DataType.FLOAT_VECTOR, dim=full_dim)
    elif full_field == "array":
        schema.add_field("full", DataType.ARRAY, element_type=DataType.FLOAT, max_capacity=full_dim)
    schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_CHARS)
    schema.add_field("meta", DataType.JSON)
    schema.add_field("tags", DataType.JSON)  # typed copy of the scalar metadata, for filters
    return schema
