"""Exact top-k of a flat index on a GPU with torch, where faiss has no GPU build.

``faiss-gpu`` (the ``gpu`` extra) copies flat and IVF indexes to a GPU. Where it cannot be
installed (no wheel for the platform or CUDA version), a large flat index would otherwise be
scanned on the CPU's cores while the GPU sits idle: :class:`TorchFlat` holds the index's vectors
on the GPU as FAISS decodes them (float32: an ``fp16`` index's vectors are exactly representable)
and answers a batch of queries with one fp32 matrix product and one ``topk``, the inner products
FAISS computes. Quantised
flat indexes (sq8, sq4, pq) stay on the CPU: their scores come from codes, not vectors.

It has FAISS's ``search(queries, k) -> (scores, ids)`` so the GPU path of
:mod:`qswap.index.backends.faiss.faiss_index` uses either; on a CPU device the same code runs
(tested against FAISS).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("qswap.index")

#: Flat indexes smaller than this stay on FAISS's CPU search: copying a query batch to a GPU and
#: back costs more than scanning a few tens of thousands of vectors on the CPU's cores.
MIN_ROWS = 50_000
#: Index quantisations whose vectors this copies exactly.
EXACT_QUANTS = ("fp32", "fp16")


class TorchFlat:
    """Vectors and their ids on ``device``; exact inner-product top-k.

    Args:
        vectors: (n, dim) float32 (or float16) vectors.
        ids: (n,) int64 ids FAISS returns for them.
        device: a torch device (``cuda``; ``cpu`` computes the same on the CPU).
    """

    def __init__(self, vectors: np.ndarray, ids: np.ndarray, device: Any = "cuda") -> None:
        import torch

        self.device = torch.device(device)
        self.vectors = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)).to(self.device)
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.device)
        self.ntotal = len(ids)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (n, k), best first; ``-1`` ids and ``-inf`` scores past the end."""
        import torch

        n = len(queries)
        kk = min(int(k), self.ntotal)
        with torch.inference_mode():
            q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)
            s = torch.matmul(q, self.vectors.t())
            top = torch.topk(s, kk, dim=1, largest=True, sorted=True)
            scores = top.values.float().cpu().numpy()
            ids = self.ids[top.indices].cpu().numpy()
        if kk < k:
            scores = np.concatenate([scores, np.full((n, k - kk), -np.inf, np.float32)], axis=1)
            ids = np.concatenate([ids, np.full((n, k - kk), -1, np.int64)], axis=1)
        return scores, ids


def torch_flat(index: Any, quant: str, device: Any = "cuda") -> TorchFlat | None:
    """A :class:`TorchFlat` of a FAISS ``IDMap2`` flat ``index`` (``None`` for a quantisation whose
    scores come from codes, or an index below :data:`MIN_ROWS` on a GPU)."""
    import faiss

    if quant not in EXACT_QUANTS:
        return None
    idx = faiss.downcast_index(index)
    if str(device).startswith("cuda") and idx.ntotal < MIN_ROWS:
        return None
    ids = faiss.vector_to_array(idx.id_map).astype(np.int64)
    inner = faiss.downcast_index(idx.index)
    vectors = inner.reconstruct_n(0, inner.ntotal) if inner.ntotal else np.zeros((0, idx.d), np.float32)
    return TorchFlat(vectors, ids, device)
