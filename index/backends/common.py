"""What every index backend answers the same way: its embedding space and dimensions from the
generation it has open, add/upsert as one ``_put`` that either refuses or replaces present ids,
whether it rescores, the checks that it is open (and writable), and its lifetime (``close``, once;
a context manager)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import numpy as np

from qswap.errors import InvalidInputError
from qswap.index.config import IndexConfig
from qswap.space import EmbeddingSpace


class BackendCommon:
    """Shared part of :class:`~qswap.index.backends.faiss.index.DocumentIndex` and
    :class:`~qswap.index.backends.milvus.collection.MilvusIndex` (both set ``_space``, ``_config``,
    ``_closed`` and ``_read_only``, and say what they are in ``_described``)."""

    _space: EmbeddingSpace
    _config: IndexConfig
    _closed: bool
    _read_only: bool
    _described: str   # how an error names it: "index <path>", "collection <name>"
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

    @property
    def _rescoring(self) -> bool:
        return self._config.rescores(self.full_dim)

    # -- checks --------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidInputError("the index is closed", "open it again")

    def _refuse_read_only(self) -> None:
        if self._read_only:
            raise InvalidInputError(f"{self._described} was opened read-only", "open it without read_only to change it")

    def _check_writable(self) -> None:
        self._check_usable()
        self._refuse_read_only()

    # -- lifetime ------------------------------------------------------------------------------

    def _closing(self) -> ContextManager[Any]:
        """What ``close`` holds: work in flight finishes first (nothing to wait for by default)."""
        return contextlib.nullcontext()

    def _release(self) -> None:
        """Give back what the open index holds (each backend's own)."""

    def close(self) -> None:
        """Release what the index holds (in-flight work finishes first); a second close does nothing."""
        with self._closing():
            if self._closed:
                return
            self._closed = True
            self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
