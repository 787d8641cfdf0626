"""A search result, shared by every index backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A metadata equality filter compares a top-level field with one of these.
FilterValue = str | int | float | bool | None


@dataclass
class Hit:
    """One search result: external id, cosine score, text (unless not asked for), metadata."""

    id: str
    score: float
    text: str | None
    metadata: dict[str, Any]
