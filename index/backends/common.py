"""What every index backend answers the same way: its embedding space and dimensions from the
generation it has open, and add/upsert as one ``_put`` that either refuses or replaces present ids."""

from __future__ import annotations

from typing import Any

import numpy as np

from qswap.index.config import IndexConfig
from qswap.space import EmbeddingSpace


class BackendCommon:
    """Shared part of :class:`~qswap.index.backends.faiss.index.DocumentIndex` and
    :class:`~qswap.index.backends.milvus.collection.MilvusIndex` (both set ``_space`` and ``_config``)."""

    _space: EmbeddingSpace
    _config: IndexConfig
    _put: Any   # (docs, embeddings, replace) -> count: each backend's writer

    @property
    def space(self) -> EmbeddingSpace:
        """Embedding space of the stored documents (queries must come from the same one)."""
        return self._space

    @property
    def config(self) -> IndexConfig:
        """The index options of the open generation."""
        return self._config

    @property
    def dim(self) -> int:
        """Dimensions kept in the vector index (Matryoshka prefix)."""
        return int(self._config.dim)

    @property
    def full_dim(self) -> int:
        """Dimensions of queries and stored embeddings."""
        return self._space.dim

    def add(self, docs: list[Any], embeddings: np.ndarray) -> int:
        """Add new documents; :class:`~qswap.errors.ConflictError` if an id is already present.
        Returns the number written."""
        return self._put(docs, embeddings, replace=False)

    def upsert(self, docs: list[Any], embeddings: np.ndarray) -> int:
        """Add documents, replacing those whose id is present. Returns the number written."""
        return self._put(docs, embeddings, replace=True)
