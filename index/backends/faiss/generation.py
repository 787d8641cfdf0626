"""Manifest building: the record of one committed generation, and the first one of a new index."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import qswap
import qswap.index.backends.faiss.faiss_index as faiss_index
from qswap.index.config import IndexConfig
from qswap.index.backends.faiss.docstore import DOCS_FILE, SCHEMA_VERSION, DocStore
from qswap.index.backends.faiss.embeddings import Chunk, EmbeddingStore
from qswap.index.manifest import FORMAT, FORMAT_VERSION, faiss_name, now_iso, write_manifest
from qswap.space import EmbeddingSpace


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
