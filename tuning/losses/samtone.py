"""SamToNe (same-tower negatives) and PAIR, the comparison it is measured against.

SamToNe (Moiseev et al., eq. 2) adds ``sum_{j != i} exp(s(q_i, q_j)/tau)`` to the
in-batch softmax denominator: query-side by default; ``doc_side`` also puts
``s(p_i, p_j)`` into the document -> query direction (which it switches on). The paper's
temperature is 0.01.

PAIR (Ren et al., eq. 3): ``-(1 - alpha) log L_c - alpha log L_P`` with
``L_P = exp(s(q_i, p_i)/tau) / sum_{j != i} exp(s(p_i, p_j)/tau)``, alpha 0.1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qswap.tuning.losses.batch import LossInput, duplicate_positive_mask
from qswap.tuning.losses.infonce import InfoNCELoss
from qswap.tuning.losses.similarity import pairwise_similarity, rowwise_similarity


class SamToNeLoss(InfoNCELoss):
    """InfoNCE with same-tower negatives in the denominator."""

    name = "samtone"

    def __init__(self, temperature: float = 0.01, metric: str = "cos", in_batch: bool = True,
                 hard_negatives: bool = True, bidirectional: bool = False,
                 doc_side: bool = False) -> None:
        super().__init__(temperature=temperature, metric=metric, in_batch=in_batch,
                         hard_negatives=hard_negatives, bidirectional=bidirectional,
                         query_same_tower=True, doc_same_tower=doc_side)


class PairLoss:
    """PAIR's hybrid loss: in-batch softmax plus a passage-passage term weighted ``alpha``."""

    name = "pair"

    def __init__(self, alpha: float = 0.1, temperature: float = 0.01, metric: str = "cos") -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"PAIR alpha must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.contrastive = InfoNCELoss(temperature=temperature, metric=metric,
                                       in_batch=True, hard_negatives=False)

    def __call__(self, x: LossInput) -> torch.Tensor:
        b = x.q.shape[0]
        if b < 2:
            raise ValueError("PAIR needs a batch of at least 2 (its passage term compares passages)")
        logits, target = self.contrastive.query_logits(x)
        l_c = F.cross_entropy(logits, target)
        tau, metric = self.contrastive.temperature, self.contrastive.metric
        eye = torch.eye(b, dtype=torch.bool, device=x.q.device)
        excluded = eye | duplicate_positive_mask(x.pos_ids, b, x.q.device)
        s_pp = pairwise_similarity(x.p, x.p, metric).masked_fill(excluded, float("-inf")) / tau
        # -log L_P = -s(q_i, p_i)/tau + logsumexp_{j != i} s(p_i, p_j)/tau; a row whose
        # every other passage is a duplicate has no term (its logsumexp would be -inf).
        lse = torch.logsumexp(s_pp, dim=1)
        valid = torch.isfinite(lse)
        l_p_rows = -rowwise_similarity(x.q, x.p, metric) / tau + torch.where(valid, lse, torch.zeros_like(lse))
        l_p = (l_p_rows * valid).sum() / valid.sum().clamp_min(1)
        return (1 - self.alpha) * l_c + self.alpha * l_p

    def config(self) -> dict[str, Any]:
        return {"loss": self.name, "alpha": self.alpha,
                "temperature": self.contrastive.temperature, "metric": self.contrastive.metric}
