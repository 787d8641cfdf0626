"""Statistics for benchmarks: percentiles, summaries, paired ratios, interleaved side-by-side arms.

Comparisons are measured side by side: :func:`interleaved` runs the arms alternately
(ABAB..., order flipped every round so neither arm always goes first) and
:func:`ratio_summary` reports per-round ratios as a median with their spread, so slow
drift of a shared machine hits both arms alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qswap.errors import InvalidInputError


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of a sample: ``numpy.percentile`` (linear interpolation).

    Args:
        values: the sample.
        q: the percentile, 0..100.

    Returns:
        The percentile; NaN for an empty sample.
    """
    if not 0 <= q <= 100:
        raise InvalidInputError(f"percentile {q} is outside 0..100", "use e.g. 50, 95, 99")
    xs = np.asarray(values, dtype=float)
    return float(np.percentile(xs, q)) if xs.size else math.nan


def timed_ms(fn: Callable[[int], Any], reps: int, warm: int = 0,
             sync: Callable[[], Any] | None = None) -> list[float]:
    """Wall times of ``fn(i)`` for ``i`` in ``range(reps)``, in milliseconds: the one latency loop.

    Args:
        fn: the call to time, given its repetition's number (e.g. which query to search).
        reps: timed calls.
        warm: untimed calls first, ``fn(0) .. fn(warm - 1)``.
        sync: waits for queued work (a GPU's stream): run before the clock starts and before
            it stops, so each time is the call's own.

    Returns:
        One time per call, in order.
    """
    for i in range(warm):
        fn(i)
    times = []
    for i in range(reps):
        if sync is not None:
            sync()
        t = time.perf_counter()
        fn(i)
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def summarize(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """``n``, ``mean``, ``min``, ``max`` and ``p<q>`` for each ``q`` of a sample."""
    xs = [float(v) for v in values]
    out: dict[str, float] = {"n": len(xs)}
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    out["min"] = min(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    for q in qs:
        out[f"p{q:g}"] = percentile(xs, q)
    return out


@dataclass
class RatioSummary:
    """Per-round ratios ``a / b``: their median, quartiles and range."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    n: int
    ratios: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "min": self.min,
                "max": self.max, "n": self.n, "ratios": self.ratios}

    def __str__(self) -> str:
        return f"{self.median:.2f}x (IQR {self.p25:.2f}-{self.p75:.2f}, n={self.n})"


def ratio_summary(a: Sequence[float], b: Sequence[float]) -> RatioSummary:
    """Summarise paired rounds: ratio of ``a[i] / b[i]`` per round (pairs with b == 0 dropped)."""
    if len(a) != len(b):
        raise InvalidInputError(f"{len(a)} rounds of A but {len(b)} of B", "pair every round")
    rs = [float(x) / float(y) for x, y in zip(a, b) if y]
    if not rs:
        return RatioSummary(math.nan, math.nan, math.nan, math.nan, math.nan, 0, [])
    return RatioSummary(percentile(rs, 50), percentile(rs, 25), percentile(rs, 75), min(rs), max(rs),
                        len(rs), rs)


def interleaved(arms: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 1,
                on_round: Callable[[int, str, Any], None] | None = None) -> dict[str, list[Any]]:
    """Run each arm once per round, alternating, and collect their results per arm.

    Round ``r`` runs the arms in the given order when ``r`` is even and reversed when odd
    (A B, B A, A B, ...), so neither always runs first (caches, thermal state, a
    neighbour's load). ``warmup`` rounds run the same way but are discarded.
    """
    if rounds < 1:
        raise InvalidInputError(f"rounds must be >= 1, got {rounds}", "use at least 3 for a spread")
    names = list(arms)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            value = arms[n]()
            if r >= warmup:
                out[n].append(value)
                if on_round is not None:
                    on_round(r - warmup, n, value)
    return out
