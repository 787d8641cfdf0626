"""Triplet margin loss (the adiabatic paper's loss: margin 0.1)."""

from __future__ import annotations

from typing import Any

import torch

from qswap.tuning.losses.batch import LossInput
from qswap.tuning.losses.similarity import check_metric, rowwise_distance


class TripletMarginLoss:
    """``mean(relu(d(q, p) - d(q, n) + margin))`` over every (query, real negative) pair.

    ``d`` is ``1 - cos`` (metric ``cos``) or the euclidean distance (``euclid``). The paper
    takes one negative per query (the first); with H negatives each pair counts once.
    """

    name = "triplet"

    def __init__(self, margin: float = 0.1, metric: str = "cos") -> None:
        self.margin = float(margin)
        self.metric = check_metric(metric)

    def __call__(self, x: LossInput) -> torch.Tensor:
        mask = x.negatives_mask()
        if mask is None:
            raise ValueError("the triplet margin loss needs at least one negative per query")
        d_pos = rowwise_distance(x.q, x.p, self.metric).unsqueeze(1)          # (B, 1)
        d_neg = rowwise_distance(x.q.unsqueeze(1), x.n, self.metric)          # (B, H)
        losses = torch.relu(d_pos - d_neg + self.margin)
        m = mask.to(losses.dtype)
        return (losses * m).sum() / m.sum().clamp_min(1.0)

    def config(self) -> dict[str, Any]:
        return {"loss": self.name, "margin": self.margin, "metric": self.metric}
