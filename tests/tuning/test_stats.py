"""Pooled two-proportion Z-test and the relative improvement, against known values."""

from __future__ import annotations

import math

import pytest

from qswap.guard.stats import compare_counts, improvement, z_test


def test_z_known_values():
    # p0 = .10, p1 = .08, P = .09: Z = -.02 / sqrt(.09 * .91 * 2 / 1000) = -1.5627
    assert z_test(100, 80, 1000) == pytest.approx(-1.56270, abs=1e-4)
    # p0 = .10, p1 = .16, P = .13: Z = .06 / sqrt(.13 * .87 * 2 / 500) = 2.8209
    assert z_test(50, 80, 500) == pytest.approx(2.82092, abs=1e-4)


def test_z_squared_is_the_uncorrected_chi_square():
    from scipy.stats import chi2_contingency
    for n0, n1, total in ((100, 80, 1000), (7, 19, 60), (309, 250, 253140)):
        chi2 = chi2_contingency([[n0, total - n0], [n1, total - n1]], correction=False)[0]
        assert z_test(n0, n1, total) ** 2 == pytest.approx(chi2, rel=1e-9)


def test_z_without_variance_is_zero():
    assert z_test(0, 0, 10) == 0.0
    assert z_test(10, 10, 10) == 0.0


def test_z_rejects_impossible_counts():
    with pytest.raises(ValueError):
        z_test(11, 0, 10)
    with pytest.raises(ValueError):
        z_test(1, 1, 0)


def test_compare_counts_names_significant_changes():
    better = compare_counts(100, 70, 1000)     # Z = -2.40
    assert better.significant and better.change == "improved" and better.improvement == pytest.approx(0.3)
    worse = compare_counts(70, 100, 1000)
    assert worse.significant and worse.change == "worsened"
    same = compare_counts(100, 80, 1000)       # |Z| = 1.56 < 1.96
    assert not same.significant and same.change == "unchanged"


def test_improvement_sign_convention():
    assert improvement(0.10, 0.08, lower_is_better=True) == pytest.approx(0.2)    # PND fell 20%
    assert improvement(0.50, 0.60, lower_is_better=False) == pytest.approx(0.2)   # MRR rose 20%
    assert improvement(0.50, 0.40, lower_is_better=False) == pytest.approx(-0.2)
    assert improvement(0.0, 0.0, lower_is_better=True) == 0.0
    assert improvement(0.0, 0.1, lower_is_better=True) == -math.inf
