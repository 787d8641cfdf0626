"""The regression guard: sentinel sets evaluated for the base and the tuned encoder.

A tuning run evaluates sentinel sets the tuning did not target (other languages, other
domains), Z-tests each change of the PND error count, and records the verdict in the
encoder manifest's ``guard`` field::

    {"passed": bool, "z_critical": 1.96, "checks": [{"name", "metric", "errors_base",
     "errors_tuned", "total", "z", "improvement", "change", "degraded"}, ...]}

:func:`check_guard` is the one place that turns a failed guard into a refusal; the
server's registration calls it (unless forced). This module imports no torch or numpy at
import time so the server can use it cheaply; evaluation imports happen inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from qswap.errors import GuardRefusedError, InvalidInputError
from qswap.tuning.stats import Z_CRITICAL, CountComparison

SENTINEL_FORMS = "beir:DIR[:QLANG[-DLANG]] or triplets:FILE, optionally prefixed NAME="


def check_guard(manifest_guard: dict[str, Any] | None) -> None:
    """Raise :class:`GuardRefusedError` if a recorded guard failed; no guard passes.

    An encoder without a guard record (hand-made, identity) is not refused: the guard
    judges evidence, and there is none. A malformed record is an :class:`InvalidInputError`.
    """
    if manifest_guard is None:
        return
    if not isinstance(manifest_guard, dict) or not isinstance(manifest_guard.get("passed"), bool):
        raise InvalidInputError("the encoder's guard record is malformed (needs a boolean 'passed')",
                                "re-run the tuning, or register with force to skip the guard")
    if manifest_guard["passed"]:
        return
    checks = manifest_guard.get("checks") or []
    bad = [c for c in checks if isinstance(c, dict) and c.get("degraded")]
    names = ", ".join(f"{c.get('name')} ({c.get('metric')}, Z={float(c.get('z', 0)):+.2f})" for c in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise GuardRefusedError(
        f"encoder significantly degrades {len(bad)} sentinel check(s): {names or 'unspecified'}{more}",
        "re-tune with a lower learning rate or more freezing, or register with force=true to accept it")


def make_check(name: str, metric: str, cmp: CountComparison) -> dict[str, Any]:
    """One guard check from a Z-tested error-count comparison."""
    return {"name": name, "metric": metric, **cmp.to_dict(), "degraded": cmp.change == "worsened"}


def guard_record(checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The manifest ``guard`` field: passed unless some check degraded significantly."""
    return {"passed": not any(c["degraded"] for c in checks), "z_critical": Z_CRITICAL, "checks": list(checks)}


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
                       progress: bool = True) -> dict[str, Any]:
    """Evaluate every sentinel for both encoders and return the manifest ``guard`` record.

    Checks PND by cosine (and by distance when the space is not L2-normalised, where the
    two differ). ``exclude`` maps a BEIR directory to query ids to leave out there (the ones
    the tuning trained on, when a sentinel shares the training directory).
    """
    from qswap.tuning.beir_eval import BeirEvaluator
    from qswap.tuning.stats import compare_counts

    evaluator = evaluator or BeirEvaluator(base, encode_tuned, cache_dir, progress)
    metrics = ["pnd_cos"] + ([] if base.spec.normalize else ["pnd_dist"])
    checks = []
    for s in sentinels:
        if s.kind == "beir":
            skip = (exclude or {}).get(Path(s.path).resolve(), ())
            r = evaluator.pair(s.path, s.query_lang, s.doc_lang or s.query_lang, exclude_qids=skip)
            b, t = r.base, r.tuned
        else:
            b, t = triplet_metrics(s.path, base, encode_tuned, cache_dir, progress)
        if b.pairs == 0:
            raise InvalidInputError(f"sentinel {s.name} has no (positive, negative) pair to compare",
                                    "give a sentinel with negatives")
        for metric in metrics:
            n0, n1 = (b.errors_cos, t.errors_cos) if metric == "pnd_cos" else (b.errors_dist, t.errors_dist)
            checks.append(make_check(s.name, metric, compare_counts(n0, n1, b.pairs)))
    return guard_record(checks)


def triplet_metrics(path: Path, base: Any, encode_tuned: Callable[[list[str]], Any],
                    cache_dir: Path | None = None, progress: bool = True) -> tuple[Any, Any]:
    """(base, tuned) :class:`~qswap.tuning.evaluation.RankingMetrics` on a triplets file."""
    from qswap.tuning.data import read_triplets
    from qswap.tuning.doc_cache import DocTable
    from qswap.tuning.evaluation import evaluate_candidates

    samples = read_triplets(path, require_negatives=True)
    table = DocTable()
    pos = [[table.add(t) for t in s.positives] for s in samples]
    neg = [[table.add(t) for t in s.negatives] for s in samples]
    docs = table.embed(base, cache_dir, progress=progress)
    queries = [s.query for s in samples]
    return (evaluate_candidates(base.encode_queries(queries), docs, pos, neg),
            evaluate_candidates(encode_tuned(queries), docs, pos, neg))
