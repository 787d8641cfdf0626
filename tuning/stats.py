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
