"""Benchmark plots (PNG): lines with bands, grouped bars, Pareto fronts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qswap.plotting import pyplot, save_figure


def _finish(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, *, legend_loc: str = "best",
            grid_axis: str = "both") -> Path:
    """Labels, grid and legend every benchmark plot has; then the PNG."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis=grid_axis, alpha=0.3)
    ax.legend(loc=legend_loc)
    return save_figure(fig, path)


def plot_lines(path: Path, x: Sequence[float], series: Mapping[str, Sequence[float]], *, xlabel: str,
               ylabel: str, title: str, logx: bool = False, logy: bool = False,
               bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
               vlines: Sequence[float] = (), vlabel: str = "") -> Path:
    """Line plot of several series over one x axis; optional shaded (low, high) band per series
    and dotted vertical markers (``vlines``, e.g. when events happened)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        (line,) = ax.plot(list(x), list(ys), marker="o", label=name)
        if bands and name in bands:
            lo, hi = bands[name]
            ax.fill_between(list(x), list(lo), list(hi), color=line.get_color(), alpha=0.15)
    for i, v in enumerate(vlines):
        ax.axvline(v, color="grey", linestyle=":", linewidth=1, label=vlabel if i == 0 and vlabel else None)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    return _finish(fig, ax, path, xlabel, ylabel, title)


def plot_bars(path: Path, labels: Sequence[str], series: Mapping[str, Sequence[float]], *, ylabel: str,
              title: str, stacked: bool = False) -> Path:
    """Grouped (or stacked) bars: one group per label, one bar per series."""
    plt = pyplot()
    import numpy as np
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) + 3), 4.5))
    xs = np.arange(len(labels))
    k = max(len(series), 1)
    width = 0.8 if stacked else 0.8 / k
    bottom = np.zeros(len(labels))
    for i, (name, ys) in enumerate(series.items()):
        ys_a = np.asarray(ys, dtype=float)
        if stacked:
            ax.bar(xs, ys_a, width, bottom=bottom, label=name)
            bottom += ys_a
        else:
            ax.bar(xs - 0.4 + width * (i + 0.5), ys_a, width, label=name)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=20 if max(map(len, labels), default=0) > 8 else 0, ha="right"
                       if max(map(len, labels), default=0) > 8 else "center")
    return _finish(fig, ax, path, "", ylabel, title, grid_axis="y")


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats: lower cost (x) and higher value (y).

    The "operating points" of FAISS's contrib module: sorted by cost, a point is kept when
    its value exceeds every cheaper point's value.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    best = -math.inf
    front = []
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def plot_pareto(path: Path, points: Sequence[tuple[float, float]], labels: Sequence[str], *, xlabel: str,
                ylabel: str, title: str, logx: bool = True) -> Path:
    """Scatter of (cost, value) with the Pareto front drawn and its points labelled."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=18, alpha=0.5, color="grey")
    front = pareto_front(points)
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-o", color="C3", label="Pareto front")
    for i in front:
        ax.annotate(labels[i], points[i], fontsize=7, xytext=(4, -8), textcoords="offset points")
    if logx:
        ax.set_xscale("log")
    return _finish(fig, ax, path, xlabel, ylabel, title, legend_loc="lower right")
