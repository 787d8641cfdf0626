"""The tuning side of the guard: scoring ``qswap tune`` sentinels (BEIR directories with their
own corpus, embedded by the base; triplet files) for the base and the tuned encoder. The checks
and the verdict come from the shared guard (:mod:`qswap.guard.checks`), as on the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from qswap.errors import InvalidInputError
from qswap.guard.checks import guard_record, judge_sentinel
from qswap.guard.record import GuardRecord, SentinelCheck
from qswap.guard.sentinels import Sentinel


def evaluate_sentinels(sentinels: Sequence[Sentinel], base: Any, encode_tuned: Callable[[list[str]], Any],
                       evaluator: Any = None, cache_dir: Path | None = None,
                       exclude: Mapping[Path, Collection[str]] | None = None,
                       progress: bool = True, extra_checks: Sequence[SentinelCheck] = ()) -> GuardRecord:
    """Evaluate every sentinel for both encoders and return the manifest ``guard`` record.

    ``exclude`` maps a BEIR directory to query ids to leave out there (the ones the tuning
    trained on, when a sentinel shares the training directory). ``extra_checks`` are checks
    already computed (the training language's held-out test queries).
    """
    from qswap.tuning.beir_eval import BeirEvaluator

    evaluator = evaluator or BeirEvaluator(base, encode_tuned, cache_dir, progress)
    checks = list(extra_checks)
    for s in sentinels:
        if s.kind == "beir":
            skip = (exclude or {}).get(Path(s.path).resolve(), ())
            r = evaluator.pair(s.path, s.query_lang, s.doc_lang or s.query_lang, exclude_qids=skip)
            b, t = r.base, r.tuned
        else:
            b, t = triplet_metrics(s.path, base, encode_tuned, cache_dir, progress,
                                   encode_base=getattr(evaluator, "encode_base", None))
        if b.queries == 0:
            raise InvalidInputError(f"sentinel {s.name} has no query with a relevant document",
                                    "give a sentinel with judged queries")
        checks += judge_sentinel(s.name, t, {"base": b}, n=b.queries, lang=s.query_lang)
    return guard_record(checks)


def triplet_metrics(path: Path, base: Any, encode_tuned: Callable[[list[str]], Any],
                    cache_dir: Path | None = None, progress: bool = True,
                    encode_base: Callable[[list[str]], Any] | None = None) -> tuple[Any, Any]:
    """(base, tuned) :class:`~qswap.guard.evaluation.RankingMetrics` on a triplets file;
    ``encode_base`` defaults to ``base.encode_queries``."""
    from qswap.tuning.data import read_triplets
    from qswap.tuning.doc_cache import DocTable
    from qswap.guard.evaluation import evaluate_candidates

    samples = read_triplets(path, require_negatives=True)
    table = DocTable()
    pos = [[table.add(t) for t in s.positives] for s in samples]
    neg = [[table.add(t) for t in s.negatives] for s in samples]
    docs = table.embed(base, cache_dir, progress=progress)
    queries = [s.query for s in samples]
    return (evaluate_candidates((encode_base or base.encode_queries)(queries), docs, pos, neg),
            evaluate_candidates(encode_tuned(queries), docs, pos, neg))
