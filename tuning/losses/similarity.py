"""Similarity and distance between embeddings, the two ways the papers measure them.

``cos`` is cosine similarity; ``euclid`` scores by negative euclidean distance so that for
both metrics a larger score means closer. Distances are the matching "smaller is closer"
forms used by the triplet margin loss: ``1 - cos`` and the euclidean distance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qswap.tuning.choices import METRICS


def check_metric(metric: str) -> str:
    """Return ``metric`` if known, else raise ValueError naming the choices."""
    if metric not in METRICS:
        raise ValueError(f"unknown similarity metric {metric!r}; expected one of {METRICS}")
    return metric


def _euclid(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # sqrt of a clamped square keeps the gradient finite where two rows coincide.
    return (a - b).pow(2).sum(-1).clamp_min(1e-24).sqrt()


def rowwise_similarity(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """Score of each row of ``a`` against the matching row of ``b`` (broadcasting over rows)."""
    if check_metric(metric) == "cos":
        return F.cosine_similarity(a, b, dim=-1)
    return -_euclid(a, b)


def pairwise_similarity(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """(n, m) scores of every row of ``a`` (n, d) against every row of ``b`` (m, d)."""
    if check_metric(metric) == "cos":
        return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
    return -_euclid(a.unsqueeze(1), b.unsqueeze(0))


def rowwise_distance(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """Distance of each row of ``a`` to the matching row of ``b``: ``1 - cos`` or euclidean."""
    if check_metric(metric) == "cos":
        return 1.0 - F.cosine_similarity(a, b, dim=-1)
    return _euclid(a, b)
