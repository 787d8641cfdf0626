"""The regression guard: sentinel sets evaluated for a reference and a new encoder.

A sentinel set is queries with relevance judgements the new encoder must not make worse
(other languages, other domains, the training language's held-out queries). Each one is
scored per query under both encoders and compared with paired tests (:mod:`qswap.tuning.stats`):

- **decides**: Wilcoxon signed-rank on per-query nDCG@10, Holm-corrected over the sentinels
  of one comparison; a check *regresses* when its adjusted p < ``alpha`` (0.05) and the mean
  nDCG@10 fell;
- **reported**: the sign test on wins/losses and the paired t-test of nDCG@10, the same
  tests on the reciprocal rank, and the adiabatic paper's pooled PND Z-test (which counts
  every (relevant, non-relevant) pair as independent and calls tiny shifts significant on
  a corpus: it is shown, never decisive). ``bench/guard_false_alarms.py`` measures both.

The record (in an encoder manifest from ``qswap tune run``, and in the server's registry
where the server's own evaluation is the one that counts)::

    {"passed": bool, "alpha": 0.05, "test": DECIDING_TEST, "checks": [{"name", "against", "n",
     "metric": "ndcg_at_10", "before", "after", "delta", "statistic", "p_value", "p_holm",
     "wins", "losses", "sign_p_value", "t_p_value", "rr": {...}, "pnd": {...}, "verdict",
     "degraded"}, ...]}

:func:`check_guard` turns a failed record into a refusal. This module imports no torch or
numpy at import time so the server can use it cheaply; evaluation imports happen inside functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from qswap.errors import GuardRefusedError, InvalidInputError
from qswap.tuning.stats import ALPHA, Z_CRITICAL, compare_counts, holm, paired_compare

SENTINEL_FORMS = "beir:DIR[:QLANG[-DLANG]] or triplets:FILE, optionally prefixed NAME="
DECIDING_TEST = "wilcoxon signed-rank on per-query ndcg@10, holm over sentinels"


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) or math.isinf(x) else x


def guard_table(record: dict[str, Any], only_bad: bool = False) -> str:
    """The checks as a short text table (one line each), for error messages and logs."""
    lines = []
    for c in record.get("checks") or []:
        if not isinstance(c, dict) or (only_bad and not c.get("degraded")):
            continue
        if "p_holm" in c:
            lines.append(f"{c.get('name')} vs {c.get('against')}: n={c.get('n')} ndcg@10 "
                         f"{float(c.get('before', 0)):.4f}->{float(c.get('after', 0)):.4f} "
                         f"p_holm={float(c.get('p_holm', 1)):.2g} {c.get('verdict')}")
        else:   # a record written before the paired tests (pooled Z only)
            lines.append(f"{c.get('name')} ({c.get('metric')}, Z={float(c.get('z', 0)):+.2f})")
    return "; ".join(lines)


def check_guard(record: dict[str, Any] | None) -> None:
    """Raise :class:`GuardRefusedError` (carrying the record) if a guard record failed.

    ``None`` (no evidence) does not raise here: whoever needs evidence (the server with
    sentinels) produces its own record first. A malformed record is an :class:`InvalidInputError`.
    """
    if record is None:
        return
    if not isinstance(record, dict) or not isinstance(record.get("passed"), bool):
        raise InvalidInputError("the encoder's guard record is malformed (needs a boolean 'passed')",
                                "re-run the tuning, or register with force to skip the guard")
    if record["passed"]:
        return
    bad = [c for c in record.get("checks") or [] if isinstance(c, dict) and c.get("degraded")]
    table = guard_table({"checks": bad[:5]})
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise GuardRefusedError(
        f"encoder significantly degrades {len(bad)} sentinel check(s): {table or 'unspecified'}{more}",
        "re-tune with a lower learning rate or more freezing, or register with force=true to accept it",
        guard=record)


def sentinel_check(name: str, before: Any, after: Any, against: str = "base",
                   lang: str | None = None) -> dict[str, Any]:
    """One check from two :class:`~qswap.tuning.evaluation.RankingMetrics` of the same queries.

    The verdict needs the other checks of its comparison (Holm): :func:`guard_record` sets it.
    """
    b, a = before.per_query, after.per_query
    if len(b.get("ndcg_at_10", ())) != len(a.get("ndcg_at_10", ())):
        raise ValueError(f"sentinel {name}: the two encoders were scored on different queries")
    ndcg = paired_compare(b["ndcg_at_10"], a["ndcg_at_10"])
    rr = paired_compare(b["rr"], a["rr"])
    check: dict[str, Any] = {
        "name": name, "against": against, "lang": lang, "n": ndcg.n, "metric": "ndcg_at_10",
        "before": ndcg.mean_before, "after": ndcg.mean_after, "delta": ndcg.delta,
        "statistic": ndcg.statistic, "p_value": ndcg.p_value, "p_holm": ndcg.p_value,
        "wins": ndcg.wins, "losses": ndcg.losses, "sign_p_value": ndcg.sign_p_value,
        "t_p_value": ndcg.t_p_value,
        "rr": {"before": rr.mean_before, "after": rr.mean_after, "p_value": rr.p_value,
               "sign_p_value": rr.sign_p_value, "wins": rr.wins, "losses": rr.losses},
        "pnd": None, "verdict": "unchanged", "degraded": False,
    }
    if before.pairs and before.pairs == after.pairs:
        z = compare_counts(before.errors_cos, after.errors_cos, before.pairs)
        check["pnd"] = {"errors_before": z.errors_base, "errors_after": z.errors_tuned, "pairs": z.total,
                        "z": _finite(z.z), "change": z.change}
    return check


def guard_record(checks: Sequence[dict[str, Any]], alpha: float = ALPHA) -> dict[str, Any]:
    """The verdict: Holm over the sentinels of each comparison, failed on any regression."""
    checks = [dict(c) for c in checks]
    for against in {c["against"] for c in checks}:
        group = [c for c in checks if c["against"] == against]
        for c, p in zip(group, holm([float(c["p_value"]) for c in group])):
            c["p_holm"] = p
            sig = p < alpha
            c["verdict"] = ("regressed" if c["delta"] < 0 else "improved") if sig and c["delta"] != 0 else "unchanged"
            c["degraded"] = c["verdict"] == "regressed"
    return {"passed": not any(c["degraded"] for c in checks), "alpha": alpha, "test": DECIDING_TEST,
            "z_critical": Z_CRITICAL, "checks": checks}


@dataclass(frozen=True)
class Sentinel:
    """A sentinel set: a BEIR (query language, document language) pair or a triplets file."""

    name: str
    kind: str                   # "beir" | "triplets"
    path: Path
    query_lang: str | None = None
    doc_lang: str | None = None


def parse_sentinel(spec: str) -> Sentinel:
    """Parse ``[NAME=]beir:DIR[:QLANG[-DLANG]]`` or ``[NAME=]triplets:FILE``."""
    name = None
    if "=" in spec.split(":", 1)[0]:
        name, spec = spec.split("=", 1)
    kind, _, rest = spec.partition(":")
    if kind not in ("beir", "triplets") or not rest:
        raise InvalidInputError(f"bad sentinel {spec!r}", f"use {SENTINEL_FORMS}")
    if kind == "triplets":
        return Sentinel(name or f"triplets:{Path(rest).name}", kind, Path(rest))
    path, ql, dl = rest, None, None
    head, sep, tail = rest.rpartition(":")
    if sep and head and not Path(rest).exists():
        path, langs = head, tail
        ql, _, dl = langs.partition("-")
        ql, dl = ql or None, dl or None
    label = f"{ql or 'queries'}->{dl or 'corpus'}"
    return Sentinel(name or f"{Path(path).name}:{label}", kind, Path(path), ql, dl or None)


def evaluate_sentinels(sentinels: Sequence[Sentinel], base: Any, encode_tuned: Callable[[list[str]], Any],
                       evaluator: Any = None, cache_dir: Path | None = None,
                       exclude: Mapping[Path, Collection[str]] | None = None,
                       progress: bool = True, extra_checks: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
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
        checks.append(sentinel_check(s.name, b, t, lang=s.query_lang))
    return guard_record(checks)


def triplet_metrics(path: Path, base: Any, encode_tuned: Callable[[list[str]], Any],
                    cache_dir: Path | None = None, progress: bool = True,
                    encode_base: Callable[[list[str]], Any] | None = None) -> tuple[Any, Any]:
    """(base, tuned) :class:`~qswap.tuning.evaluation.RankingMetrics` on a triplets file;
    ``encode_base`` defaults to ``base.encode_queries``."""
    from qswap.tuning.data import read_triplets
    from qswap.tuning.doc_cache import DocTable
    from qswap.tuning.evaluation import evaluate_candidates

    samples = read_triplets(path, require_negatives=True)
    table = DocTable()
    pos = [[table.add(t) for t in s.positives] for s in samples]
    neg = [[table.add(t) for t in s.negatives] for s in samples]
    docs = table.embed(base, cache_dir, progress=progress)
    queries = [s.query for s in samples]
    return (evaluate_candidates((encode_base or base.encode_queries)(queries), docs, pos, neg),
            evaluate_candidates(encode_tuned(queries), docs, pos, neg))
