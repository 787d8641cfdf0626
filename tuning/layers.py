"""The "most changed layers" diagnostic of the adiabatic paper (tables 14-15).

For every tensor the tuning changed: ``max_weight`` = the largest weight of the tuned
tensor (table 14 ranks changed layers by it), ``relative_max_change`` =
``(W_t - W_o) / (W_t + W_o)`` with W the largest weight of the tuned / original tensor
(table 15). Also reported: the largest absolute change and ``||W_t - W_o|| / ||W_o||``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class LayerChange:
    name: str
    max_weight: float
    max_weight_original: float
    relative_max_change: float
    max_abs_change: float
    relative_norm_change: float | None   # None where the original tensor is all zeros


def short_name(name: str) -> str:
    """Drop the ``encoder.layer.`` prefix, as the paper's tables do."""
    for prefix in ("base_model.model.", "encoder.layer.", "encoder.layers."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def layer_changes(original: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor]) -> list[LayerChange]:
    """One record per tensor of ``tuned`` that differs from ``original`` (same names)."""
    out = []
    for name, t in tuned.items():
        o = original[name].detach().to(device="cpu", dtype=torch.float64)
        t = t.detach().to(device="cpu", dtype=torch.float64)
        if torch.equal(o, t):
            continue
        w_t, w_o = float(t.max()), float(o.max())
        denom = w_t + w_o
        delta = t - o
        out.append(LayerChange(
            name=name, max_weight=w_t, max_weight_original=w_o,
            relative_max_change=(w_t - w_o) / denom if denom != 0 else 0.0,
            max_abs_change=float(delta.abs().max()),
            relative_norm_change=float(delta.norm() / o.norm()) if bool(o.any()) else None))
    return out


def most_changed(changes: list[LayerChange], top: int = 2) -> dict[str, list[dict[str, Any]]]:
    """The ``top`` layers by each criterion (paper: table 14, table 15; plus two of ours)."""
    def pick(key: str) -> list[dict[str, Any]]:
        ranked = sorted((c for c in changes if getattr(c, key) is not None),
                        key=lambda c: getattr(c, key), reverse=True)[:top]
        return [{"layer": short_name(c.name), key: getattr(c, key)} for c in ranked]
    return {"max_weight": pick("max_weight"), "relative_max_change": pick("relative_max_change"),
            "max_abs_change": pick("max_abs_change"), "relative_norm_change": pick("relative_norm_change")}


def changes_report(original: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor],
                   top: int = 2) -> dict[str, Any]:
    """JSON-ready: counts, the most changed layers, and every changed tensor."""
    changes = layer_changes(original, tuned)
    return {"changed_tensors": len(changes), "compared_tensors": len(tuned),
            "most_changed": most_changed(changes, top),
            "all": [asdict(c) | {"layer": short_name(c.name)} for c in changes]}
