"""The torch exact top-k for flat indexes (the GPU search where faiss-gpu is missing), run on the
CPU against FAISS's own search of the same index."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from qswap.index.backends.faiss.faiss_index import _torch_gpu
from qswap.index.backends.faiss.torch_flat import MIN_ROWS, torch_flat
from qswap.index.config import IndexConfig


def _index(quant: str, n: int = 3000, dim: int = 48) -> tuple[faiss.Index, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    storage = {"fp32": "Flat", "fp16": "SQfp16", "sq8": "SQ8"}[quant]
    index = faiss.index_factory(dim, f"IDMap2,{storage}", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    ids = rng.permutation(10 * n)[:n].astype(np.int64)   # ids are rows of a log: not 0..n-1
    index.add_with_ids(x, ids)
    q = rng.standard_normal((17, dim)).astype(np.float32)
    return index, q / np.linalg.norm(q, axis=1, keepdims=True)


@pytest.mark.parametrize("quant", ["fp32", "fp16"])
def test_torch_topk_equals_faiss(quant):
    index, q = _index(quant)
    flat = torch_flat(index, quant, device="cpu")
    for k in (1, 10, 100):
        d_ref, i_ref = index.search(q, k)
        d, i = flat.search(q, k)
        assert np.array_equal(i, i_ref)
        assert np.allclose(d, d_ref, atol=1e-5)


def test_k_beyond_the_index_pads_like_faiss():
    index, q = _index("fp32", n=5)
    d_ref, i_ref = index.search(q, 8)
    d, i = torch_flat(index, "fp32", device="cpu").search(q, 8)
    assert np.array_equal(i, i_ref) and np.array_equal(i[:, 5:], np.full((len(q), 3), -1))


def test_codes_and_small_indexes_stay_on_faiss():
    index, _ = _index("sq8")
    assert torch_flat(index, "sq8", device="cpu") is None        # scores come from codes
    small, _ = _index("fp32")
    assert small.ntotal < MIN_ROWS and torch_flat(small, "fp32", device="cuda") is None
    # Without a CUDA device (this machine) the GPU path declines and FAISS searches on the CPU.
    cfg = IndexConfig(kind="flat", quant="fp32", dim=48)
    assert _torch_gpu(small, cfg) is None
