"""What every loss receives: query embeddings with grad, frozen document embeddings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass
class LossInput:
    """One training batch in embedding form.

    ``q`` (B, d): queries from the trainable tower (carry grad). ``p`` (B, d): each query's
    positive, from the frozen text tower. ``n`` (B, H, d): up to H hard negatives per query
    (frozen) with ``n_mask`` (B, H) marking real ones (rows may have fewer than H).
    ``pos_ids`` (B,): an id per positive document, so that a document that is the positive
    of two queries in one batch is not used as an in-batch negative of either.
    """

    q: torch.Tensor
    p: torch.Tensor
    n: torch.Tensor | None = None
    n_mask: torch.Tensor | None = None
    pos_ids: torch.Tensor | None = None

    def negatives_mask(self) -> torch.Tensor | None:
        """(B, H) bool mask of real negatives, or None when there are none."""
        if self.n is None or self.n.shape[1] == 0:
            return None
        if self.n_mask is None:
            return torch.ones(self.n.shape[:2], dtype=torch.bool, device=self.n.device)
        return self.n_mask.bool()

    def map_embeddings(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "LossInput":
        """The same batch with ``fn`` applied to q, p and n (e.g. Matryoshka truncation)."""
        return replace(self, q=fn(self.q), p=fn(self.p),
                       n=fn(self.n) if self.n is not None else None)


def duplicate_positive_mask(pos_ids: torch.Tensor | None, b: int, device: torch.device) -> torch.Tensor:
    """(B, B) True where j != i but j's positive is the same document as i's."""
    if pos_ids is None:
        return torch.zeros((b, b), dtype=torch.bool, device=device)
    same = pos_ids.view(-1, 1) == pos_ids.view(1, -1)
    return same & ~torch.eye(b, dtype=torch.bool, device=device)
