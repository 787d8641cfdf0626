"""The frozen text tower, used once: document embeddings computed once and cached.

Documents never change during query-tower tuning, so they are embedded a single time by the
document tower (:func:`qswap.encoders.runtime.documents.document_encoder`, fp32) and stored as float16 ``.npy`` under
``<cache>/<space fingerprint>/<sha256 of the texts>.npy`` with a JSON record of the space.
A cached file is used only if its recorded space equals the base's space. Documents a
qswap index already holds can instead take the index's stored embeddings
(:class:`StoredEmbeddings`, from ``DocumentIndex.export_embeddings``), after the same
space check.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qswap.atomic import atomic_write_bytes, atomic_write_json
from qswap.encoders import BaseEncoder
from qswap.encoders.runtime.documents import document_encoder
from qswap.errors import IntegrityError
from qswap.paths import data_dir
from qswap.space import EmbeddingSpace


_TEXT_KEY = "\x00text:"


def default_cache_dir() -> Path:
    """``<data dir>/doc-cache``."""
    return data_dir() / "doc-cache"


def texts_sha256(texts: list[str]) -> str:
    """Hash of an ordered list of texts (length-prefixed, so no two lists collide by joining)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


@dataclass
class StoredEmbeddings:
    """Document embeddings an index already stores, by document id (float16 rows)."""

    rows: dict[str, int]
    vectors: np.ndarray
    space: EmbeddingSpace

    @classmethod
    def from_index(cls, index: Any) -> "StoredEmbeddings":
        """Every live document of a ``qswap.index.DocumentIndex`` (one read of its float16 log)."""
        ids, vectors = index.export_embeddings()
        return cls({d: i for i, d in enumerate(ids)}, vectors, index.space)


def embed_documents(base: BaseEncoder, texts: list[str], cache_dir: Path | None = None,
                    progress: bool = True, ids: list[str | None] | None = None,
                    stored: StoredEmbeddings | None = None) -> np.ndarray:
    """(n, dim) float32 document embeddings of ``texts``, from the cache when present.

    With ``stored`` (and the documents' ``ids``), documents the index holds take its stored
    embeddings and only the rest are embedded. ``cache_dir=None`` uses
    :func:`default_cache_dir`; pass a path to keep caches elsewhere.
    """
    if stored is not None and ids is not None:
        base.space.require_same(stored.space, "stored index embeddings")
        have = [i for i, d in enumerate(ids) if d is not None and d in stored.rows]
        if have:
            out = np.empty((len(texts), base.dim), dtype=np.float32)
            out[have] = stored.vectors[[stored.rows[ids[i]] for i in have]].astype(np.float32)
            held = set(have)
            rest = [i for i in range(len(texts)) if i not in held]
            if rest:
                out[rest] = _embed_cached(base, [texts[i] for i in rest], cache_dir, progress)
            return out
    return _embed_cached(base, texts, cache_dir, progress)


def _embed_cached(base: BaseEncoder, texts: list[str], cache_dir: Path | None, progress: bool) -> np.ndarray:
    if not texts:
        return np.zeros((0, base.dim), dtype=np.float32)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = texts_sha256(texts)
    folder = root / base.space.fingerprint
    npy, meta = folder / f"{key[:32]}.npy", folder / f"{key[:32]}.json"
    if npy.exists() and meta.exists():
        try:
            record = json.loads(meta.read_text())
            cached_space = EmbeddingSpace.from_dict(record["space"])
            arr = np.load(npy)
        except (OSError, ValueError, KeyError) as e:
            raise IntegrityError(f"document cache {npy} is unreadable: {e}",
                                 f"delete {folder} and run again") from None
        base.space.require_same(cached_space, f"document cache {npy}")
        if arr.shape != (len(texts), base.dim) or record.get("texts_sha256") != key:
            raise IntegrityError(f"document cache {npy} does not match its texts",
                                 f"delete {npy} and run again")
        return arr.astype(np.float32)
    emb = document_encoder(base).encode(texts, progress=progress)
    buf = io.BytesIO()
    np.save(buf, emb.astype(np.float16))
    atomic_write_bytes(npy, buf.getvalue())
    atomic_write_json(meta, {"space": base.space.to_dict(), "texts_sha256": key, "count": len(texts)})
    # Return what a later run will read, so a first and a cached run train identically.
    return emb.astype(np.float16).astype(np.float32)


@dataclass
class DocTable:
    """Unique documents of a run (keyed by id, or by text when there is no id) and their embeddings."""

    texts: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    emb: np.ndarray | None = None
    index_ids: dict[int, str] = field(default_factory=dict)   # row -> id in a qswap index
    _row: dict[str, int] = field(default_factory=dict)

    def add(self, text: str, key: str | None = None, index_id: str | None = None) -> int:
        """Row of a document, adding it if new; ``key`` is its id (default: its text),
        ``index_id`` its id in the index stored embeddings may come from (default: ``key``)."""
        k = key if key is not None else _TEXT_KEY + text
        row = self._row.get(k)
        if row is None:
            row = self._row[k] = len(self.texts)
            self.texts.append(text)
            self.keys.append(k)
        if index_id is not None or key is not None:
            self.index_ids.setdefault(row, index_id if index_id is not None else key)
        return row

    def row(self, key: str) -> int | None:
        """Row of a document id (None if absent)."""
        return self._row.get(key)

    def __len__(self) -> int:
        return len(self.texts)

    def embed(self, base: BaseEncoder, cache_dir: Path | None = None, progress: bool = True,
              stored: StoredEmbeddings | None = None) -> np.ndarray:
        """Embed the rows added since the last call (each increment cached on its own;
        rows an index holds take its ``stored`` embeddings)."""
        done = 0 if self.emb is None else len(self.emb)
        if self.emb is None or done < len(self.texts):
            ids = [self.index_ids.get(r) for r in range(done, len(self.texts))]
            new = embed_documents(base, self.texts[done:], cache_dir, progress, ids, stored)
            self.emb = new if self.emb is None else np.concatenate([self.emb, new])
        return self.emb
