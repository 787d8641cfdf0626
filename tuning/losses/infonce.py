"""InfoNCE: in-batch sampled softmax with optional hard negatives (Arctic-Embed: tau 0.02).

One class covers the whole family the papers compare, so SamToNe and the bidirectional
form differ from plain InfoNCE only in which columns enter the softmax denominator:

- query -> document: ``s(q_i, p_j)`` for every positive in the batch (``in_batch``) or just
  ``p_i``; plus hard negatives (every negative in the batch when ``in_batch``, else the
  query's own); plus ``s(q_i, q_j), j != i`` when ``query_same_tower`` (SamToNe).
- document -> query (``bidirectional``): ``s(p_i, q_j)`` for every query in the batch;
  plus ``s(p_i, p_j), j != i`` when ``doc_same_tower`` (SamToNe on the document side).

A document that is the positive of two queries in one batch is masked out as a negative
of both (it would be a false negative). With a frozen text tower the document-side terms
use stored embeddings and carry no gradient themselves; gradients reach the query tower
through every term that contains a query.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qswap.tuning.losses.batch import LossInput, duplicate_positive_mask
from qswap.tuning.losses.similarity import check_metric, pairwise_similarity, rowwise_similarity

_NEG_INF = float("-inf")


class InfoNCELoss:
    """Softmax cross-entropy over candidate documents, temperature ``tau``."""

    name = "infonce"

    def __init__(self, temperature: float = 0.02, metric: str = "cos", in_batch: bool = True,
                 hard_negatives: bool = True, bidirectional: bool = False,
                 query_same_tower: bool = False, doc_same_tower: bool = False) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.metric = check_metric(metric)
        self.in_batch = in_batch
        self.hard_negatives = hard_negatives
        self.bidirectional = bidirectional or doc_same_tower
        self.query_same_tower = query_same_tower
        self.doc_same_tower = doc_same_tower

    def query_logits(self, x: LossInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) query -> candidate scores (already divided by tau) and the target column."""
        q, p = x.q, x.p
        b, dev = q.shape[0], q.device
        dup = duplicate_positive_mask(x.pos_ids, b, dev)
        if self.in_batch:
            blocks = [pairwise_similarity(q, p, self.metric).masked_fill(dup, _NEG_INF)]
            target = torch.arange(b, device=dev)
        else:
            blocks = [rowwise_similarity(q, p, self.metric).unsqueeze(1)]
            target = torch.zeros(b, dtype=torch.long, device=dev)
        mask = x.negatives_mask() if self.hard_negatives else None
        if mask is not None:
            n = x.n
            if self.in_batch:
                s = pairwise_similarity(q, n.reshape(-1, n.shape[-1]), self.metric)   # (B, B*H)
                s = s.masked_fill(~mask.reshape(1, -1), _NEG_INF)
            else:
                s = rowwise_similarity(q.unsqueeze(1), n, self.metric).masked_fill(~mask, _NEG_INF)
            blocks.append(s)
        if self.query_same_tower:
            eye = torch.eye(b, dtype=torch.bool, device=dev)
            blocks.append(pairwise_similarity(q, q, self.metric).masked_fill(eye, _NEG_INF))
        return torch.cat(blocks, dim=1) / self.temperature, target

    def doc_logits(self, x: LossInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) document -> query scores (divided by tau) and the target column."""
        q, p = x.q, x.p
        b, dev = q.shape[0], q.device
        dup = duplicate_positive_mask(x.pos_ids, b, dev)
        blocks = [pairwise_similarity(p, q, self.metric).masked_fill(dup, _NEG_INF)]
        if self.doc_same_tower:
            eye = torch.eye(b, dtype=torch.bool, device=dev)
            blocks.append(pairwise_similarity(p, p, self.metric).masked_fill(eye | dup, _NEG_INF))
        return torch.cat(blocks, dim=1) / self.temperature, torch.arange(b, device=dev)

    def __call__(self, x: LossInput) -> torch.Tensor:
        logits, target = self.query_logits(x)
        loss = F.cross_entropy(logits, target)
        if self.bidirectional:
            d_logits, d_target = self.doc_logits(x)
            loss = (loss + F.cross_entropy(d_logits, d_target)) / 2
        return loss

    def config(self) -> dict[str, Any]:
        return {"loss": self.name, "temperature": self.temperature, "metric": self.metric,
                "in_batch": self.in_batch, "hard_negatives": self.hard_negatives,
                "bidirectional": self.bidirectional, "query_same_tower": self.query_same_tower,
                "doc_same_tower": self.doc_same_tower}
