"""Training losses for the query tower; documents arrive as frozen embeddings.

- :class:`TripletMarginLoss` (adiabatic tuning, margin 0.1),
- :class:`InfoNCELoss` (in-batch + hard negatives, tau 0.02; ``bidirectional`` option),
- :class:`SamToNeLoss` (same-tower negatives, tau 0.01), :class:`PairLoss` (PAIR, alpha 0.1),
- :class:`MatryoshkaLoss` (any of them at several prefix dimensions).

Every loss is called with a :class:`LossInput` and returns a scalar tensor.
"""

from __future__ import annotations

from typing import Sequence

from qswap.errors import InvalidInputError
from qswap.tuning.losses.batch import LossInput
from qswap.tuning.losses.infonce import InfoNCELoss
from qswap.tuning.losses.matryoshka import MatryoshkaLoss
from qswap.tuning.losses.samtone import PairLoss, SamToNeLoss
from qswap.tuning.choices import LOSSES, METRICS
from qswap.tuning.losses.triplet import TripletMarginLoss

__all__ = ["LOSSES", "METRICS", "InfoNCELoss", "LossInput", "MatryoshkaLoss", "PairLoss",
           "SamToNeLoss", "TripletMarginLoss", "build_loss"]


def build_loss(kind: str = "triplet", *, metric: str = "cos", margin: float = 0.1,
               temperature: float | None = None, in_batch: bool = True,
               hard_negatives: bool = True, bidirectional: bool = False, doc_side: bool = False,
               pair_alpha: float = 0.1, matryoshka_dims: Sequence[int] | None = None):
    """Build a loss by name with the papers' defaults.

    ``temperature`` defaults to 0.02 for InfoNCE (Arctic-Embed) and 0.01 for SamToNe and
    PAIR (their papers). ``matryoshka_dims`` wraps the loss in :class:`MatryoshkaLoss`.
    """
    if metric not in METRICS:
        raise InvalidInputError(f"unknown similarity metric {metric!r}", f"use one of {', '.join(METRICS)}")
    if kind == "triplet":
        loss = TripletMarginLoss(margin=margin, metric=metric)
    elif kind == "infonce":
        loss = InfoNCELoss(temperature=temperature or 0.02, metric=metric, in_batch=in_batch,
                           hard_negatives=hard_negatives, bidirectional=bidirectional)
    elif kind == "samtone":
        loss = SamToNeLoss(temperature=temperature or 0.01, metric=metric, in_batch=in_batch,
                           hard_negatives=hard_negatives, bidirectional=bidirectional,
                           doc_side=doc_side)
    elif kind == "pair":
        loss = PairLoss(alpha=pair_alpha, temperature=temperature or 0.01, metric=metric)
    else:
        raise InvalidInputError(f"unknown loss {kind!r}", f"use one of {', '.join(LOSSES)}")
    if matryoshka_dims:
        loss = MatryoshkaLoss(loss, matryoshka_dims)
    return loss
