"""Evaluating a tuning run: the saved encoder against the trained tower, then base vs tuned on
the held-out test queries, the evaluation languages and the sentinels (the guard's verdict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qswap.encoders.base import BaseEncoder
from qswap.errors import IntegrityError
from qswap.guard.checks import guard_record, sentinel_check
from qswap.guard.evaluation import compare_metrics, evaluate_candidates
from qswap.guard.record import GuardRecord, SentinelCheck
from qswap.tuning.beir_eval import BeirEvaluator
from qswap.tuning.config import RunConfig
from qswap.tuning.data import BeirData
from qswap.tuning.doc_cache import StoredEmbeddings
from qswap.tuning.guard import evaluate_sentinels
from qswap.tuning.methods import QueryTower
from qswap.tuning.multilingual import language_matrix, plot_heatmap
from qswap.tuning.preparation import Prepared
from qswap.tuning.queries import Encode, FastQueries
from qswap.tuning.report import HEATMAP


def artifact_check(fast: FastQueries, tower: QueryTower, key: str, encode: Encode,
                   queries: list[str]) -> dict[str, Any]:
    """Compare the saved encoder ``key`` (loaded into ``fast``'s pool the way the server loads
    it) and its fast-runtime ``encode`` with the trained tower."""
    served = fast.pool.encode(queries, [key] * len(queries))
    trained = tower.encode(queries)
    diff = float(np.abs(served - trained).max()) if len(queries) else 0.0
    if diff > 1e-4:
        raise IntegrityError(f"the saved encoder does not reproduce the tuned tower (max difference {diff:.2e})",
                             "this is a bug in the adapter export; report it with the run's options")
    cos = float((encode(queries) * trained).sum(axis=1).min()) if len(queries) else 1.0
    return {"queries": len(queries), "max_abs_difference": diff, "runtime": fast.runtime.get(key),
            "runtime_min_cosine": cos}


def evaluate_run(cfg: RunConfig, base: BaseEncoder, encode_base: Encode, encode_tuned: Encode, prep: Prepared,
                    beir: BeirData | None, splits: Any, sentinels: list[Any], report_dir: Path,
                 stored: StoredEmbeddings | None) -> tuple[dict[str, Any], GuardRecord]:
    """(evaluation, guard): base vs tuned on the test split, languages and sentinels."""
    evaluation: dict[str, Any] = {}
    # The guard also checks the training task itself, on its held-out test queries: an
    # encoder can get worse where it was tuned.
    own: list[SentinelCheck] = []
    test_samples, test_rows = prep.sets["test"]
    if test_samples and beir is None:
        # Triplet data: each test query against its own candidates.
        q = [s.query for s in test_samples]
        pos, neg = [r[0] for r in test_rows], [r[1] for r in test_rows]
        mb = evaluate_candidates(encode_base(q), prep.table.emb, pos, neg)
        mt = evaluate_candidates(encode_tuned(q), prep.table.emb, pos, neg)
        evaluation["test"] = compare_metrics(mb, mt)
        own.append(sentinel_check("training data (held-out test)", mb, mt))
    evaluator = BeirEvaluator(base, encode_tuned, cfg.cache_dir, cfg.progress, stored=stored, encode_base=encode_base)
    if beir is not None and test_samples:
        # BEIR: test queries against the whole corpus, in every evaluation language.
        langs = cfg.eval_langs or [cfg.lang or ""]
        matrix = language_matrix(evaluator, cfg.beir_dir, [lg or None for lg in langs],
                                 keep_qids={s.qid for s in test_samples})
        main_cell = matrix.cells.get((cfg.lang, cfg.lang)) or matrix.cells.get((cfg.lang, None))
        if main_cell is not None:
            evaluation["retrieval"] = main_cell.comparison()
            own.append(sentinel_check(f"{cfg.lang or 'training'} (held-out test)", main_cell.base, main_cell.tuned,
                                      lang=cfg.lang))
        evaluation["multilingual"] = matrix.to_dict()
        plot_heatmap(matrix, report_dir / HEATMAP)
    if not sentinels:
        return evaluation, guard_record(own)
    exclude = None
    if beir is not None:
        # A sentinel in the training directory must not score queries the tuning saw.
        exclude = {Path(cfg.beir_dir).resolve(): {s.qid for s in splits.train + splits.validation}}
    return evaluation, evaluate_sentinels(sentinels, base, encode_tuned, evaluator, cfg.cache_dir,
                                          exclude=exclude, progress=cfg.progress, extra_checks=own)
