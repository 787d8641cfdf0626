"""The guard's checks and verdict: per-query metrics of two encoders on a sentinel, compared.

A sentinel set is queries with relevance judgements the new encoder must not make worse
(other languages, other domains, the training language's held-out queries). Each one is
scored per query under both encoders and compared with paired tests (:mod:`qswap.guard.stats`):

- **decides**: Wilcoxon signed-rank on per-query nDCG@10, Holm-corrected over the sentinels
  of one comparison; a check *regresses* when its adjusted p < ``alpha`` (0.05) and the mean
  nDCG@10 fell;
- **reported**: the sign test on wins/losses and the paired t-test of nDCG@10, the same
  tests on the reciprocal rank, and the adiabatic paper's pooled PND Z-test (which counts
  every (relevant, non-relevant) pair as independent and calls tiny shifts significant on
  a corpus: it is shown, never decisive). ``bench/guard_false_alarms.py`` measures both.

The record is a :class:`~qswap.guard.record.GuardRecord` of
:class:`~qswap.guard.record.SentinelCheck` (in an encoder manifest from ``qswap tune run``, and in
the server's registry where the server's own evaluation is the one that counts).

:func:`check_guard` turns a failed record into a refusal. This module imports no torch or
numpy at import time so the server can use it cheaply; evaluation imports happen inside functions.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from pydantic import ValidationError

from qswap.errors import GuardRefusedError, InvalidInputError
from qswap.guard.record import INSUFFICIENT, GuardRecord, PooledZ, RankChange, SentinelCheck
from qswap.guard.stats import ALPHA, Z_CRITICAL, compare_counts, holm, paired_compare
from qswap.guard.status import GuardStatus

DECIDING_TEST = "wilcoxon signed-rank on per-query ndcg@10, holm over sentinels"


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) or math.isinf(x) else x


def _read(record: GuardRecord | dict[str, Any]) -> GuardRecord:
    if isinstance(record, GuardRecord):
        return record
    try:
        return GuardRecord.of(record)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "record"
        raise InvalidInputError(f"the encoder's guard record is malformed: {where}: {err.get('msg', '')}",
                                "re-run the tuning, or register with force to skip the guard") from None


def guard_table(record: GuardRecord | dict[str, Any], only_bad: bool = False) -> str:
    """The checks as a short text table (one line each), for error messages and logs."""
    lines = []
    for c in _read(record).checks:
        if only_bad and not c.degraded:
            continue
        if c.verdict == INSUFFICIENT:
            lines.append(f"{c.name} vs {c.against}: n={c.n} {INSUFFICIENT}")
        elif c.p_holm is not None:
            lines.append(f"{c.name} vs {c.against}: n={c.n} ndcg@10 {c.before or 0:.4f}->{c.after or 0:.4f} "
                         f"p_holm={c.p_holm:.2g} {c.verdict}")
        else:   # a record written before the paired tests (pooled Z only)
            lines.append(f"{c.name} ({c.metric}, Z={float((c.model_extra or {}).get('z', 0)):+.2f})")
    return "; ".join(lines)


def check_guard(record: GuardRecord | dict[str, Any] | None) -> None:
    """Raise :class:`GuardRefusedError` (carrying the record) if a guard record failed.

    ``None`` (no evidence) does not raise here: whoever needs evidence (the server with
    sentinels) produces its own record first. A malformed record is an :class:`InvalidInputError`.
    """
    if record is None:
        return
    if not isinstance(record, GuardRecord) and (not isinstance(record, dict)
                                                or not isinstance(record.get("passed"), bool)):
        raise InvalidInputError("the encoder's guard record is malformed (needs a boolean 'passed')",
                                "re-run the tuning, or register with force to skip the guard")
    rec = _read(record)
    if rec.passed:
        return
    bad = rec.regressed()
    table = guard_table(GuardRecord(passed=False, checks=bad[:5]))
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise GuardRefusedError(
        f"encoder significantly degrades {len(bad)} sentinel check(s): {table or 'unspecified'}{more}",
        "re-tune with a lower learning rate or more freezing, or register with force=true to accept it",
        guard=rec.to_json())


def sentinel_check(name: str, before: Any, after: Any, against: str = "base",
                   lang: str | None = None) -> SentinelCheck:
    """One check from two :class:`~qswap.guard.evaluation.RankingMetrics` of the same queries.

    The verdict needs the other checks of its comparison (Holm): :func:`guard_record` sets it.
    """
    b, a = before.per_query, after.per_query
    if len(b.get("ndcg_at_10", ())) != len(a.get("ndcg_at_10", ())):
        raise ValueError(f"sentinel {name}: the two encoders were scored on different queries")
    ndcg = paired_compare(b["ndcg_at_10"], a["ndcg_at_10"])
    rr = paired_compare(b["rr"], a["rr"])
    pnd = None
    if before.pairs and before.pairs == after.pairs:
        z = compare_counts(before.errors_cos, after.errors_cos, before.pairs)
        pnd = PooledZ(errors_before=z.errors_base, errors_after=z.errors_tuned, pairs=z.total, z=_finite(z.z),
                      change=z.change)
    return SentinelCheck(
        name=name, against=against, lang=lang, n=ndcg.n, metric="ndcg_at_10",
        before=ndcg.mean_before, after=ndcg.mean_after, delta=ndcg.delta,
        statistic=ndcg.statistic, p_value=ndcg.p_value, p_holm=ndcg.p_value,
        wins=ndcg.wins, losses=ndcg.losses, sign_p_value=ndcg.sign_p_value, t_p_value=ndcg.t_p_value,
        rr=RankChange(before=rr.mean_before, after=rr.mean_after, p_value=rr.p_value,
                      sign_p_value=rr.sign_p_value, wins=rr.wins, losses=rr.losses),
        pnd=pnd, verdict="unchanged", degraded=False)


def insufficient_check(name: str, n: int, against: str = "base", lang: str | None = None) -> SentinelCheck:
    """A check of a sentinel with too few judged queries left to compare anything (``n`` of them)."""
    return SentinelCheck(name=name, against=against, lang=lang, n=n, metric="ndcg_at_10",
                         verdict=INSUFFICIENT, degraded=False)


def judge_sentinel(name: str, after: Any, before: Mapping[str, Any], n: int, lang: str | None = None,
                   min_queries: int = 1) -> list[SentinelCheck]:
    """The checks of one sentinel: the one evaluator the server and ``qswap tune`` share.

    Args:
        name: the sentinel.
        after: :class:`~qswap.guard.evaluation.RankingMetrics` of the evaluated encoder.
        before: reference encoder -> its metrics on the same queries.
        n: the sentinel's judged queries that were scored.
        lang: the sentinel's query language.
        min_queries: fewer than this many queries decide nothing.

    Returns:
        One check per reference; ``insufficient_evidence`` ones when ``n < min_queries``
        (the metrics are not read then and may be None).
    """
    if n < min_queries or after is None:
        return [insufficient_check(name, n, against=r, lang=lang) for r in before]
    return [sentinel_check(name, b, after, against=r, lang=lang) for r, b in before.items()]


def guard_record(checks: Sequence[SentinelCheck], alpha: float = ALPHA, min_queries: int = 1) -> GuardRecord:
    """The verdict: Holm over the sentinels of each comparison, failed on any regression.

    A check scored on fewer than ``min_queries`` queries decides nothing (a Wilcoxon test on 5
    queries cannot reach p < 0.05 whatever happened): its verdict is ``insufficient_evidence``,
    it is left out of the Holm correction, and the record's verdict is ``insufficient_evidence``
    unless another check regressed (``refused``). ``passed`` is true only for ``passed``.
    """
    checks = [c.model_copy(update={"min_queries": min_queries}) for c in checks]
    for c in checks:
        if (c.n or 0) < min_queries:
            c.verdict, c.degraded = INSUFFICIENT, False
    judged = [c for c in checks if c.verdict != INSUFFICIENT]
    for against in {c.against for c in judged}:
        group = [c for c in judged if c.against == against]
        for c, p in zip(group, holm([float(c.p_value) for c in group])):   # type: ignore[arg-type]
            c.p_holm = p
            delta = c.delta or 0.0
            sig = p < alpha
            c.verdict = ("regressed" if delta < 0 else "improved") if sig and delta != 0 else "unchanged"
            c.degraded = c.verdict == "regressed"
    verdict = (GuardStatus.REFUSED if any(c.degraded for c in checks)
               else GuardStatus.INSUFFICIENT if len(judged) < len(checks) else GuardStatus.PASSED)
    return GuardRecord(passed=verdict == GuardStatus.PASSED, verdict=verdict, alpha=alpha, min_queries=min_queries,
                       test=DECIDING_TEST, z_critical=Z_CRITICAL, checks=checks)


def insufficient_table(record: GuardRecord | dict[str, Any]) -> str:
    """The checks without enough evidence, as text ("sentinel x has 6 judged queries left, needs 20")."""
    seen = {c.name: c for c in reversed(_read(record).insufficient())}
    return "; ".join(f"sentinel {n} has {c.n} judged queries left, needs {c.min_queries}"
                     for n, c in reversed(seen.items())) or "too few judged queries"
