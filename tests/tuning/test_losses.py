"""Each loss against values computed by hand on a two-row batch of 2-d vectors.

q1 = (1, 0), q2 = (0, 1); p1 = (1, 0), p2 = (1, 1)/sqrt 2; n1 = (0, 1), n2 = (0, 1).
Cosines: q1.p1 = 1, q1.p2 = r, q2.p1 = 0, q2.p2 = r (r = 1/sqrt 2), q.n: q1 0, q2 1,
q1.q2 = 0, p1.p2 = r.
"""

from __future__ import annotations

import math

import pytest
import torch

from qswap.errors import InvalidInputError
from qswap.tuning.losses import (InfoNCELoss, LossInput, MatryoshkaLoss, PairLoss, SamToNeLoss,
                                 TripletMarginLoss, build_loss)

R = 1 / math.sqrt(2)


def batch(pos_ids=None, with_neg=True) -> LossInput:
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    p = torch.tensor([[1.0, 0.0], [R, R]], dtype=torch.float64)
    n = torch.tensor([[[0.0, 1.0]], [[0.0, 1.0]]], dtype=torch.float64)
    return LossInput(q, p, n if with_neg else None, pos_ids=pos_ids)


def val(t: torch.Tensor) -> float:
    return float(t.detach())


def nll(target: float, logits: list[float]) -> float:
    return -target + math.log(sum(math.exp(v) for v in logits))


def test_triplet_cosine_by_hand():
    # row 1: relu(0 - 1 + 0.1) = 0; row 2: relu((1 - r) - 0 + 0.1)
    expected = (0.0 + (1 - R + 0.1)) / 2
    assert val(TripletMarginLoss(0.1, "cos")(batch())) == pytest.approx(expected, abs=1e-12)


def test_triplet_euclidean_by_hand():
    # row 1: relu(0 - sqrt2 + 0.1) = 0; row 2: |q2 - p2| = sqrt(2 - sqrt2), |q2 - n2| = 0
    expected = (math.sqrt(2 - math.sqrt(2)) + 0.1) / 2
    assert val(TripletMarginLoss(0.1, "euclid")(batch())) == pytest.approx(expected, abs=1e-9)


def test_triplet_masks_missing_negatives():
    x = batch()
    x.n = torch.cat([x.n, torch.zeros_like(x.n)], dim=1)           # a padded second negative
    x.n_mask = torch.tensor([[True, False], [True, False]])
    assert val(TripletMarginLoss()(x)) == pytest.approx((1 - R + 0.1) / 2, abs=1e-12)


def test_triplet_needs_a_negative():
    with pytest.raises(ValueError):
        TripletMarginLoss()(batch(with_neg=False))


def test_infonce_in_batch_by_hand():
    expected = (nll(1, [1, R]) + nll(R, [0, R])) / 2
    loss = InfoNCELoss(temperature=1.0, hard_negatives=False)(batch())
    assert val(loss) == pytest.approx(expected, abs=1e-12)


def test_infonce_temperature_scales_logits():
    t = 0.5
    expected = (nll(1 / t, [1 / t, R / t]) + nll(R / t, [0, R / t])) / 2
    assert val(InfoNCELoss(temperature=t, hard_negatives=False)(batch())) == pytest.approx(expected, abs=1e-12)


def test_infonce_with_hard_negatives_in_batch_by_hand():
    # candidates of every row: p1, p2, n1, n2 (every hard negative of the batch)
    expected = (nll(1, [1, R, 0, 0]) + nll(R, [0, R, 1, 1])) / 2
    assert val(InfoNCELoss(temperature=1.0)(batch())) == pytest.approx(expected, abs=1e-12)


def test_infonce_own_negatives_only_by_hand():
    expected = (nll(1, [1, 0]) + nll(R, [R, 1])) / 2
    assert val(InfoNCELoss(temperature=1.0, in_batch=False)(batch())) == pytest.approx(expected, abs=1e-12)


def test_infonce_bidirectional_by_hand():
    q_to_d = (nll(1, [1, R]) + nll(R, [0, R])) / 2
    d_to_q = (nll(1, [1, 0]) + nll(R, [R, R])) / 2      # p1 -> (q1, q2); p2 -> (q1, q2)
    loss = InfoNCELoss(temperature=1.0, hard_negatives=False, bidirectional=True)(batch())
    assert val(loss) == pytest.approx((q_to_d + d_to_q) / 2, abs=1e-12)


def test_duplicate_positive_is_not_a_negative():
    # Both queries share one positive document: the other row's copy is masked out.
    x = batch(pos_ids=torch.tensor([5, 5]))
    expected = (nll(1, [1]) + nll(R, [R])) / 2
    assert val(InfoNCELoss(temperature=1.0, hard_negatives=False)(x)) == pytest.approx(expected, abs=1e-12)


def test_samtone_query_side_by_hand():
    # plus s(q_i, q_j), j != i, which is 0 for both rows
    expected = (nll(1, [1, R, 0]) + nll(R, [0, R, 0])) / 2
    assert val(SamToNeLoss(temperature=1.0, hard_negatives=False)(batch())) == pytest.approx(expected, abs=1e-12)


def test_samtone_document_side_by_hand():
    q_side = (nll(1, [1, R, 0]) + nll(R, [0, R, 0])) / 2
    d_side = (nll(1, [1, 0, R]) + nll(R, [R, R, R])) / 2  # p_i -> q's, plus s(p_i, p_j) = r
    loss = SamToNeLoss(temperature=1.0, hard_negatives=False, doc_side=True)(batch())
    assert val(loss) == pytest.approx((q_side + d_side) / 2, abs=1e-12)


def test_samtone_default_temperature_is_the_papers():
    assert SamToNeLoss().temperature == 0.01
    assert build_loss("infonce").temperature == 0.02


def test_pair_by_hand():
    alpha = 0.1
    l_c = (nll(1, [1, R]) + nll(R, [0, R])) / 2
    # -log L_P = -s(q_i, p_i) + log sum_{j != i} exp(s(p_i, p_j)); s(p1, p2) = r
    l_p = ((-1 + R) + (-R + R)) / 2
    loss = PairLoss(alpha=alpha, temperature=1.0)(batch())
    assert val(loss) == pytest.approx((1 - alpha) * l_c + alpha * l_p, abs=1e-12)


def test_matryoshka_sums_the_loss_at_each_prefix():
    # 3-d rows whose 2-d prefixes are the batch above; the 3rd coordinate changes cosines.
    q = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([[1.0, 0.0, 0.0], [R, R, 0.0]], dtype=torch.float64)
    n = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 1.0, 0.0]]], dtype=torch.float64)
    x = LossInput(q, p, n)
    # full: row 1 cos(q1, p1) = r, cos(q1, n1) = 0 -> relu((1 - r) - 1 + 0.1) = 0 (r > 0.1);
    #       row 2 as before (1 - r + 0.1). 2-d prefix: the batch above.
    full = (0.0 + (1 - R + 0.1)) / 2
    prefix = (0.0 + (1 - R + 0.1)) / 2
    loss = MatryoshkaLoss(TripletMarginLoss(), [3, 2], weights=[1.0, 0.5])(x)
    assert val(loss) == pytest.approx(full + 0.5 * prefix, abs=1e-12)


def test_matryoshka_rejects_a_dimension_above_the_embedding():
    with pytest.raises(InvalidInputError):
        build_loss("triplet", matryoshka_dims=[4])(batch())


def test_gradients_reach_only_the_queries():
    x = batch()
    build_loss("samtone", doc_side=True)(x).backward()
    assert x.q.grad is not None and torch.isfinite(x.q.grad).all() and x.q.grad.abs().sum() > 0


def test_unknown_loss_is_a_named_error():
    with pytest.raises(InvalidInputError):
        build_loss("hinge")
