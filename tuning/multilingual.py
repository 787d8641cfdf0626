"""Multilingual check: a query-language x document-language matrix (the paper's figure 1).

Each cell compares the base and the tuned query encoder on the queries of one language
against the corpus of another: the PND improvement ``I`` and the pooled Z-test of the PND
error counts. Summary counts are "significantly improved / significantly worsened" pairs
("222/0" in the paper). A directory without per-language corpora has one document column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Sequence

from qswap.tuning.beir_eval import BeirEvaluator, PairResult


def doc_languages(directory: Path, query_langs: Sequence[str]) -> list[str | None]:
    """Languages with their own ``corpus-<lang>.jsonl``; ``[None]`` (the one corpus) if none."""
    found = [lang for lang in query_langs if (Path(directory) / f"corpus-{lang}.jsonl").exists()]
    return found or [None]


def _label(lang: str | None) -> str:
    return lang if lang else "corpus"


@dataclass
class LanguageMatrix:
    query_langs: list[str]
    doc_langs: list[str | None]
    metric: str = "pnd_cos"
    cells: dict[tuple[str, str | None], PairResult] = field(default_factory=dict)

    def comparison(self, ql: str, dl: str | None) -> dict[str, Any]:
        return self.cells[(ql, dl)].comparison()

    def improvement(self, ql: str, dl: str | None) -> float:
        v = self.comparison(ql, dl)["metrics"][self.metric]["improvement"]
        return float("nan") if v is None else v

    def z_test(self, ql: str, dl: str | None) -> dict[str, Any]:
        return self.comparison(ql, dl)["z_tests"][self.metric]

    def counts(self) -> dict[str, int]:
        changes = [self.z_test(ql, dl)["change"] for (ql, dl) in self.cells]
        return {"improved": changes.count("improved"), "worsened": changes.count("worsened"),
                "pairs": len(changes)}

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "query_langs": self.query_langs,
                "doc_langs": [_label(d) for d in self.doc_langs], "counts": self.counts(),
                "cells": [{"query_lang": ql, "doc_lang": _label(dl), **self.comparison(ql, dl)}
                          for (ql, dl) in self.cells]}


def language_matrix(evaluator: BeirEvaluator, directory: Path, query_langs: Sequence[str],
                    doc_langs: Sequence[str | None] | None = None, keep_qids: Collection[str] | None = None,
                    exclude_qids: Collection[str] = (), metric: str = "pnd_cos") -> LanguageMatrix:
    """Evaluate every (query language, document language) pair of a BEIR directory."""
    dls = list(doc_langs) if doc_langs is not None else doc_languages(directory, query_langs)
    m = LanguageMatrix(list(query_langs), dls, metric)
    for ql in query_langs:
        for dl in dls:
            m.cells[(ql, dl)] = evaluator.pair(directory, ql, dl, keep_qids, exclude_qids)
    return m


def plot_heatmap(m: LanguageMatrix, path: Path, title: str = "") -> Path:
    """PNG heatmap of the improvement (%) per pair; significant cells bold, others faded."""
    from qswap.plotting import pyplot, save_figure
    plt = pyplot()
    import numpy as np

    vals = np.array([[m.improvement(ql, dl) * 100 for dl in m.doc_langs] for ql in m.query_langs])
    sig = np.array([[m.z_test(ql, dl)["significant"] for dl in m.doc_langs] for ql in m.query_langs])
    finite = vals[np.isfinite(vals)]
    lim = max(float(np.abs(finite).max()) if finite.size else 1.0, 1e-6)
    fig, ax = plt.subplots(figsize=(max(4.2, 1.6 + 0.7 * len(m.doc_langs)), max(2.6, 1.2 + 0.55 * len(m.query_langs))))
    im = ax.imshow(np.ma.masked_invalid(vals), cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i in range(len(m.query_langs)):
        for j in range(len(m.doc_langs)):
            v = vals[i, j]
            txt = "n/a" if not math.isfinite(v) else f"{v:.1f}"
            dark = math.isfinite(v) and abs(v) > 0.6 * lim
            ax.text(j, i, txt, ha="center", va="center", fontsize=8, color="white" if dark else "black",
                    fontweight="bold" if sig[i, j] else "normal", alpha=1.0 if sig[i, j] else 0.45)
    ax.set_xticks(range(len(m.doc_langs)), [_label(d) for d in m.doc_langs])
    ax.set_yticks(range(len(m.query_langs)), m.query_langs)
    ax.set_xlabel("document language")
    ax.set_ylabel("query language")
    c = m.counts()
    ax.set_title(title or f"{m.metric} improvement %\n{c['improved']} improved / {c['worsened']} worsened "
                 f"of {c['pairs']} (|Z| > 1.96)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return save_figure(fig, path)
