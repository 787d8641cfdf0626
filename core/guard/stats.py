"""Significance and relative improvement, as the adiabatic paper reports them.

The paper's appendix I prints a garbled form of the test; this is the standard pooled
two-proportion Z-test (recipe.md): error counts ``n0`` (original) and ``n1`` (tuned)
out of the same total ``N``,

    Z = (p1 - p0) / sqrt(P (1 - P) * 2 / N),  p0 = n0/N, p1 = n1/N, P = (n0 + n1) / (2N),

significant when ``|Z| > 1.96``. Negative Z means the tuned encoder makes fewer errors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

Z_CRITICAL = 1.96


def z_test(n0: int, n1: int, total: int) -> float:
    """Pooled two-proportion Z statistic for error counts ``n0`` -> ``n1`` out of ``total``.

    Returns 0.0 when the pooled proportion is 0 or 1 (no variance: nothing to test).
    """
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    if not (0 <= n0 <= total and 0 <= n1 <= total):
        raise ValueError(f"error counts {n0}, {n1} must lie in [0, {total}]")
    pooled = (n0 + n1) / (2 * total)
    var = pooled * (1 - pooled) * 2 / total
    if var <= 0:
        return 0.0
    return (n1 / total - n0 / total) / math.sqrt(var)


def improvement(original: float, tuned: float, lower_is_better: bool) -> float:
    """Relative improvement ``I = s (M_tuned - M_orig) / M_orig`` (s = -1 for error-like M).

    Returns 0.0 when both are 0, and +-inf when only the original is 0.
    """
    s = -1.0 if lower_is_better else 1.0
    if original == 0:
        if tuned == original:
            return 0.0
        return math.copysign(math.inf, s * (tuned - original))
    return s * (tuned - original) / abs(original)


@dataclass(frozen=True)
class CountComparison:
    """Error counts of the original and the tuned encoder on the same comparisons."""

    errors_base: int
    errors_tuned: int
    total: int
    z: float
    significant: bool
    change: str          # "improved" | "worsened" | "unchanged" (significant changes only)
    improvement: float   # relative change of the error rate, positive = fewer errors

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # JSON has no infinity: an improvement from zero errors is reported as null.
        if math.isinf(self.improvement):
            d["improvement"] = None
        return d


def compare_counts(errors_base: int, errors_tuned: int, total: int,
                   z_critical: float = Z_CRITICAL) -> CountComparison:
    """Z-test an error-count change and name its direction when significant."""
    z = z_test(errors_base, errors_tuned, total)
    sig = abs(z) > z_critical
    change = ("improved" if z < 0 else "worsened") if sig else "unchanged"
    return CountComparison(int(errors_base), int(errors_tuned), int(total), z, sig, change,
                           improvement(errors_base / total, errors_tuned / total, lower_is_better=True))


# ----------------------------------------------------------------------------- paired tests
#
# The pooled Z-test above treats every (positive, negative) pair as an independent trial;
# on a corpus each query contributes thousands of pairs that move together, so it calls
# tiny shifts "significant". The guard decides on per-query paired tests instead: one
# observation per query (its nDCG@10 or reciprocal rank under each encoder).

ALPHA = 0.05


@dataclass(frozen=True)
class PairedComparison:
    """One metric per query under two encoders, compared pairwise."""

    n: int
    mean_before: float
    mean_after: float
    delta: float            # mean_after - mean_before (higher is better for nDCG and RR)
    wins: int               # queries that got better
    losses: int             # queries that got worse
    statistic: float        # Wilcoxon signed-rank W (over the non-zero differences)
    p_value: float          # two-sided Wilcoxon signed-rank p (1.0 when nothing changed)
    sign_p_value: float     # two-sided exact binomial sign test on wins vs losses
    t_p_value: float        # two-sided paired t-test p (1.0 when nothing changed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_compare(before: Any, after: Any) -> PairedComparison:
    """Wilcoxon signed-rank, paired t and sign tests of per-query values ``before`` -> ``after``.

    Queries whose value did not change carry no information on the direction and are left
    out of the Wilcoxon and sign tests (``zero_method="wilcox"``, the classical form).
    """
    import numpy as np
    from scipy import stats as st

    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1:
        raise ValueError(f"per-query values must be two 1-d arrays of one length, got {b.shape} and {a.shape}")
    n = len(b)
    d = a - b
    # Float noise of an identical ranking (another batch composition) is not a change.
    d[np.abs(d) < 1e-9] = 0.0
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    if wins + losses == 0:
        w, p, tp = 0.0, 1.0, 1.0
    else:
        nz = d[d != 0]
        # Exact null distribution for a few untied differences; otherwise the normal
        # approximation with its tie correction (scipy's "auto" would switch to a
        # 9,999-resample permutation test on ties: seconds per call, for no gain at n > 25).
        exact = len(nz) <= 25 and len(np.unique(np.abs(nz))) == len(nz)
        res = st.wilcoxon(nz, zero_method="wilcox", alternative="two-sided",
                          method="exact" if exact else "asymptotic")
        w, p = float(res.statistic), float(res.pvalue)
        tp = float(st.ttest_1samp(d, 0.0).pvalue) if np.std(d) > 0 else (0.0 if n > 1 else 1.0)
    sign_p = float(st.binomtest(wins, wins + losses, 0.5).pvalue) if wins + losses else 1.0
    return PairedComparison(n, float(b.mean()) if n else 0.0, float(a.mean()) if n else 0.0,
                            float(d.mean()) if n else 0.0, wins, losses, w, p, sign_p, tp)


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (same order as given), capped at 1."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
