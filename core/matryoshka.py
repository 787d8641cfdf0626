"""Matryoshka truncation: keep a prefix of the embedding and renormalise it.

One implementation for every consumer: the index (FAISS vectors of a prefix dimension), the
query encoders and the Matryoshka loss. numpy arrays and torch tensors alike; torch is only
touched when a tensor is given, so the core stays free of it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from qswap.errors import InvalidInputError

T = TypeVar("T", bound=Any)


def truncate(x: T, dim: int) -> T:
    """Cut rows of ``x`` to their first ``dim`` coordinates and L2-normalise them again.

    numpy input comes back float32 and C-contiguous (what FAISS takes); an all-zero row stays zero.
    """
    full = x.shape[-1]
    if not 0 < dim <= full:
        raise InvalidInputError(f"cannot truncate {full}-dim embeddings to {dim}",
                                f"choose a dimension between 1 and {full}")
    if not isinstance(x, np.ndarray):   # a torch tensor
        import torch
        return x if dim == full else torch.nn.functional.normalize(x[..., :dim], dim=-1)
    y = np.ascontiguousarray(x[..., :dim], dtype=np.float32)
    n = np.linalg.norm(y, axis=-1, keepdims=True)
    return np.ascontiguousarray(y / np.maximum(n, 1e-12))
