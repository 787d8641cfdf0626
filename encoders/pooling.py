"""Pooling token states into one vector per text."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # tensor methods only: importing this module does not import torch
    import torch

POOLINGS = ("mean", "cls")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Pool ``hidden`` (n, L, d) over the attention mask: ``mean`` of real tokens, or ``cls``."""
    if kind == "mean":
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
    if kind == "cls":
        return hidden[:, 0]
    raise ValueError(f"unknown pooling {kind!r}; expected one of {POOLINGS}")
