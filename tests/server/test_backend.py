"""server/backend.py: the torch backend's bf16 batches and backend choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qswap.errors import InvalidInputError


def test_torch_backend_runs_large_batches_in_bf16(tiny_base, encoders_root):
    from qswap.encoders import EncoderPool, load_encoder
    from qswap.encoders.runtime.backend import TorchBackend, make_backend
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(encoders_root / "ft1", tiny_base.space))
    texts = [f"query number {i} about chess" for i in range(8)]
    keys = ["ft@1"] * 8
    fp32 = TorchBackend(pool).encode(texts, keys)
    bf16 = TorchBackend(pool, "bf16", bf16_min_batch=8)
    assert [bf16.precision_for(n) for n in (1, 7, 8, 64)] == ["fp32", "fp32", "bf16", "bf16"]
    assert bf16.precision_for(64, encoders=2) == "fp32"
    # Below the threshold: exactly the fp32 answer; at it: bf16 rounding, still the same direction.
    assert np.array_equal(bf16.encode(texts[:7], keys[:7]), fp32[:7])
    got = bf16.encode(texts, keys)
    assert not np.array_equal(got, fp32)
    assert np.sum(got * fp32, axis=1).min() > 0.99
    # A batch mixing encoders stays fp32.
    mixed = ["ft@1", "base"] * 4
    assert np.array_equal(bf16.encode(texts, mixed), TorchBackend(pool).encode(texts, mixed))
    with pytest.raises(InvalidInputError, match="torch backend"):
        make_backend("onnx", pool, Path("/nonexistent"), precision="bf16")
    with pytest.raises(InvalidInputError, match="unknown precision"):
        TorchBackend(pool, "fp16")
