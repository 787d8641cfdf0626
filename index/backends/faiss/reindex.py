"""Re-indexing a FAISS-backed DocumentIndex from its stored vectors (no re-embedding).

Options merge as given (:meth:`IndexConfig.merged_into`); a change of shape rebuilds FAISS
while searches go on and swaps it in as one commit; search-time options only rewrite the
manifest. :meth:`ReindexMixin.with_config` makes an in-memory variant for evaluation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import qswap.index.backends.faiss.faiss_index as faiss_index
from qswap.index.config import IndexConfig

# Options that change what FAISS stores (a change re-indexes); the others are search-time.
SHAPE_FIELDS = ("dim", "quant", "kind", "nlist", "hnsw_m", "ef_construction", "pq_m")


class ReindexMixin:
    """Option changes of DocumentIndex."""

    _lock: Any
    _config: IndexConfig
    _m: dict[str, Any]

    def reindex(self, config: IndexConfig, progress: bool = False) -> None:
        """Rebuild FAISS with other options from the stored embeddings (no re-embedding).

        The new FAISS index is built while searches go on; only the swap blocks them. When
        only search-time options (nprobe, ef_search, rescore, oversample, use_gpu) change,
        the manifest is updated and FAISS kept.
        """
        with self._changing():
            new = self._merge_config(config)
            shape_changed = any(getattr(new, f) != getattr(self._config, f) for f in SHAPE_FIELDS)
            self._commit(config=new, rebuild=shape_changed, snapshot=shape_changed, progress=progress)

    def _merge_config(self, config: IndexConfig) -> IndexConfig:
        """Options set in ``config`` (not ``None``) override the current ones."""
        return config.merged_into(self._config).resolve(self._count, self.full_dim)

    def with_config(self, config: IndexConfig, progress: bool = False) -> Any:
        """An in-memory, read-only variant with other options over the same stored vectors.

        Nothing is written; used to evaluate or tune settings without re-embedding.
        """
        with self._lock.read():
            self._check_usable()
            new = self._merge_config(config)
            shape_changed = any(getattr(new, f) != getattr(self._config, f) for f in SHAPE_FIELDS)
            live = self._docs.live_rows(self._gen)
            if shape_changed:
                index, plan = faiss_index.build(new, self._store, live, progress=progress)
                tomb = np.zeros(0, np.int64)
                faiss_rec = {**self._m["faiss"], **plan.to_dict()}
            else:
                index, tomb, faiss_rec = self._faiss, self._tombstones, self._m["faiss"]
            v = type(self)()
            v.path = self.path
            v._read_only = True
            v._ephemeral = True
            v._owns_docs = False
            v._parent = self
            m = {**self._m, "config": new.index_dict(), "dim": new.dim, "faiss": faiss_rec}
            v._set_state(m=m, space=self._space, config=new, docs=self._docs, store=self._store, index=index,
                         tombstones=tomb, count=self._count, digest=self._digest)
            return v
