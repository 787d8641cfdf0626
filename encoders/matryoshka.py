"""Matryoshka truncation: keep a prefix of the embedding and renormalise it."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from qswap.errors import InvalidInputError

T = TypeVar("T", np.ndarray, torch.Tensor)


def truncate(x: T, dim: int) -> T:
    """Cut rows of ``x`` to their first ``dim`` coordinates and L2-normalise them again."""
    full = x.shape[-1]
    if not 0 < dim <= full:
        raise InvalidInputError(f"cannot truncate {full}-dim embeddings to {dim}",
                                f"choose a dimension between 1 and {full}")
    if dim == full:
        return x
    if isinstance(x, torch.Tensor):
        return torch.nn.functional.normalize(x[..., :dim], dim=-1)
    y = np.ascontiguousarray(x[..., :dim], dtype=np.float32)
    n = np.linalg.norm(y, axis=-1, keepdims=True)
    return y / np.maximum(n, 1e-12)
