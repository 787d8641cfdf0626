"""The one Matryoshka truncation (qswap.matryoshka), as the index and the encoders use it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qswap.errors import InvalidInputError
from qswap.matryoshka import truncate


def test_numpy_rows_float32_contiguous_and_renormalised():
    x = np.random.default_rng(1).normal(size=(6, 8)).astype(np.float16)
    x[2] = 0
    y = truncate(x, 5)
    assert y.dtype == np.float32 and y.flags.c_contiguous and y.shape == (6, 5)
    norms = np.linalg.norm(y, axis=1)
    assert norms[2] == 0 and np.allclose(np.delete(norms, 2), 1.0, atol=1e-6)
    # full width still renormalises (float16 storage leaves norms off 1)
    full = truncate(x, 8)
    assert full.dtype == np.float32 and np.allclose(np.delete(np.linalg.norm(full, axis=1), 2), 1.0, atol=1e-6)


def test_torch_matches_numpy_and_full_width_is_untouched():
    x = np.random.default_rng(2).normal(size=(4, 8)).astype(np.float32)
    t = torch.from_numpy(x)
    np.testing.assert_allclose(truncate(t, 3).numpy(), truncate(x, 3), rtol=1e-6)
    assert truncate(t, 8) is t


def test_index_uses_the_same_function_and_bad_dims_are_refused():
    import qswap.index.backends.milvus.collection as milvus
    import qswap.index.backends.faiss.faiss_index as faiss_index
    import qswap.index.backends.faiss.search as search
    assert faiss_index.truncate is truncate and search.truncate is truncate and milvus.truncate is truncate
    for dim in (0, 9):
        with pytest.raises(InvalidInputError):
            truncate(np.ones((2, 8), np.float32), dim)
