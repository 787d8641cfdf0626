"""The language matrix: counts of significant changes and the heatmap PNG."""

from __future__ import annotations

from qswap.tuning.beir_eval import BeirEvaluator, PairResult
from qswap.guard.evaluation import RankingMetrics
from qswap.tuning.multilingual import LanguageMatrix, language_matrix, plot_heatmap


def _m(errors: int, pairs: int = 1000) -> RankingMetrics:
    return RankingMetrics(queries=10, pnd_cos=errors / pairs, pnd_dist=errors / pairs, errors_cos=errors,
                          errors_dist=errors, pairs=pairs, pnd_queries=10)


def test_counts_and_heatmap(tmp_path):
    m = LanguageMatrix(["en", "de"], ["en", "de"])
    m.cells = {("en", "en"): PairResult("en", "en", _m(100), _m(60)),     # improved
               ("en", "de"): PairResult("en", "de", _m(100), _m(95)),     # not significant
               ("de", "en"): PairResult("de", "en", _m(100), _m(140)),    # worsened
               ("de", "de"): PairResult("de", "de", _m(100), _m(70))}     # improved
    assert m.counts() == {"improved": 2, "worsened": 1, "pairs": 4}
    d = m.to_dict()
    assert d["doc_langs"] == ["en", "de"] and len(d["cells"]) == 4
    png = plot_heatmap(m, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matrix_over_a_beir_directory(tiny_base, tuning_data, tmp_path):
    ev = BeirEvaluator(tiny_base, tiny_base.encode_queries, tmp_path, progress=False)
    m = language_matrix(ev, tuning_data["beir"], ["en", "de"], keep_qids={f"q{i}" for i in range(20)})
    assert m.doc_langs == [None] and m.counts() == {"improved": 0, "worsened": 0, "pairs": 2}
    cell = m.cells[("de", None)]
    assert cell.base.queries == 20 and cell.base.errors_cos == cell.tuned.errors_cos
