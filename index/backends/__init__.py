"""Index backends: one interface over the embedded FAISS index and a Milvus collection.

Both keep an immutable *generation* of the index's options and embedding space: the
manifest (FAISS: ``manifest.json`` in the folder; Milvus: a collection property) is checked on
open, and a query must come from the same embedding space.

    idx = open_index("/data/index")                              # FAISS folder
    idx = open_index("milvus://./docs.db?collection=docs")       # milvus-lite file
    idx = open_index("milvus://milvus.internal:19530?collection=docs")  # Milvus server

:class:`IndexBackend` is what the server and the tools use: search with metadata filters,
add / upsert / delete by external id, reads by id, the open generation's ``manifest``,
``config`` and ``space``, ``info()`` (stats) and ``close()`` (also as a context manager).
Callers type against it and open through :func:`open_index`, never probing for attributes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from qswap.index.config import IndexConfig
from qswap.index.corpus import Document
from qswap.index.hit import FilterValue, Hit
from qswap.space import EmbeddingSpace

BACKENDS = ("faiss", "milvus")
MILVUS_SCHEME = "milvus://"


@runtime_checkable
class IndexBackend(Protocol):
    """A document index of one embedding space (FAISS folder or Milvus collection)."""

    @property
    def space(self) -> EmbeddingSpace:
        """Embedding space of the stored documents (queries must come from the same one)."""

    @property
    def config(self) -> IndexConfig:
        """The index options of the open generation."""

    @property
    def manifest(self) -> dict[str, Any]:
        """The open generation's manifest: space, options and ``build`` facts (model, precision)."""

    @property
    def count(self) -> int:
        """Live documents."""

    @property
    def dim(self) -> int:
        """Dimensions kept in the vector index (Matryoshka prefix)."""

    @property
    def full_dim(self) -> int:
        """Dimensions of queries and stored embeddings."""

    def search(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
               with_text: bool = True) -> list[list[Hit]]: ...

    def search_exact(self, queries: np.ndarray, k: int, filter: dict[str, FilterValue] | None = None,
                     with_text: bool = False) -> list[list[Hit]]: ...

    def add(self, docs: list[Document], embeddings: np.ndarray) -> int: ...

    def upsert(self, docs: list[Document], embeddings: np.ndarray) -> int: ...

    def delete(self, ids: list[str]) -> int: ...

    def get(self, ids: list[str]) -> list[Document | None]: ...

    def get_embeddings(self, ids: list[str]) -> np.ndarray: ...

    def export_embeddings(self) -> tuple[list[str], np.ndarray]: ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> IndexBackend: ...

    def __exit__(self, *exc: object) -> None: ...


def is_milvus(location: str | Path) -> bool:
    """True for a ``milvus://`` (or ``milvus+https://``) index location."""
    return str(location).startswith((MILVUS_SCHEME, "milvus+https://"))


def open_index(location: str | Path, *, read_only: bool = False, expected_space: EmbeddingSpace | None = None,
               verify: bool = True) -> IndexBackend:
    """Open an index by location: a folder (FAISS) or ``milvus://URI?collection=NAME``.

    Args:
        location: an index folder, or ``milvus://HOST:PORT?collection=NAME`` (``milvus://./file.db?...``
            for milvus-lite).
        read_only: refuse changes through this handle (a FAISS folder then takes no writer lock).
        expected_space: the embedding space the caller's vectors are in; another one raises
            :class:`~qswap.errors.SpaceMismatchError`.
        verify: check the FAISS folder's checksums while opening.

    Returns:
        The index, behind the :class:`IndexBackend` interface.
    """
    if is_milvus(location):
        from qswap.index.backends.milvus.collection import MilvusIndex
        return MilvusIndex.open_location(str(location), read_only=read_only, expected_space=expected_space)
    from qswap.index.backends.faiss.index import DocumentIndex
    return DocumentIndex.open(Path(location), read_only=read_only, expected_space=expected_space, verify=verify)


def search_on_this_thread() -> None:
    """Make every later search of a FAISS index made from the calling thread run on that thread alone.

    FAISS spreads a batch of queries over OpenMP threads, one per core. A thread that searches
    while other work holds the cores (the server's answer stage, beside the next forward pass)
    gains nothing from that: the extra threads take cores from the forward pass and spin after
    each search. Measured on 2 cores, one domain at 8 concurrent searches: the batch's FAISS call
    5.1 ms with two threads; bench/results/request_overhead/edge13/ has the before and after.
    A Milvus collection searches in its own server: nothing changes for it.
    """
    from qswap.index.backends.faiss.faiss_index import limit_threads
    limit_threads(1)
