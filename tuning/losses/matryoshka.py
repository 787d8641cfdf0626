"""Matryoshka wrapper: the same loss at several embedding prefixes (Arctic-Embed: 256)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from qswap.matryoshka import truncate
from qswap.tuning.losses.batch import LossInput


class MatryoshkaLoss:
    """``sum_k w_k * inner(truncate(batch, dims[k]))``.

    Truncation keeps the first ``dim`` coordinates and renormalises, exactly as a
    server-side truncated index does, so the loss trains the representation the index
    will store. The full dimension may be one of ``dims``; weights default to 1 each.
    """

    def __init__(self, inner: Callable[[LossInput], torch.Tensor], dims: Sequence[int],
                 weights: Sequence[float] | None = None) -> None:
        if not dims:
            raise ValueError("Matryoshka loss needs at least one dimension")
        if weights is not None and len(weights) != len(dims):
            raise ValueError(f"{len(weights)} Matryoshka weights for {len(dims)} dimensions")
        self.inner = inner
        self.dims = [int(d) for d in dims]
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(self.dims)
        self.name = f"matryoshka({getattr(inner, 'name', 'loss')})"

    def __call__(self, x: LossInput) -> torch.Tensor:
        total = x.q.new_zeros(())
        for dim, w in zip(self.dims, self.weights):
            total = total + w * self.inner(x.map_embeddings(lambda t, d=dim: truncate(t, d)))
        return total

    def config(self) -> dict[str, Any]:
        inner_cfg = self.inner.config() if hasattr(self.inner, "config") else {}
        return {**inner_cfg, "matryoshka_dims": self.dims, "matryoshka_weights": self.weights}
