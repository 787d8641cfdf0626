"""Interleaving vs an A/B test on click-through, each run to a fixed power (``qswap bench domains``).

The simulated user is ``qswap bench loop``'s cascade click model; the rankings are the
server's (base and a domain encoder on the domain's held-out queries, fetched over HTTP).
Impressions are independent (a query drawn uniformly, then the user's clicks), so an
experiment's outcome per impression has a fixed distribution:

- interleaving (the server's team-draft code): P(win), P(loss), P(tie), exact per query over
  every sequence of the team draft's coin tosses and the cascade user's clicks;
- A/B on click-through: P(at least one click) of each arm's ranking, exact under the cascade
  model (:func:`click_probability`).

Exact odds matter: an estimated P(win) - P(loss) would be a difference of its own, which the
simulated experiments would then detect. Each seeded experiment draws impressions from these
distributions (numpy, millions per second) and applies the same decision rules as ``qswap bench loop`` (the server's sign test on
decided impressions at doubling looks, Bonferroni; Fisher's exact test on click-through at the
same looks of total impressions) with enough looks that at least ``power`` of the experiments
decide. Reported: the median and the ``power`` quantile of impressions to decide, per method,
and their ratios.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np

from qswap.bench.loop import CascadeUser
from qswap.feedback.interleave import CANDIDATE, Interleaving, decided, looks, team_draft


def click_probability(user: CascadeUser, ids: Sequence[str], grades: dict[str, int]) -> float:
    """P(the user clicks at least once on ``ids``), exact for :class:`CascadeUser`.

    From the last result up: no click from position i on = not clicking i, then either
    abandoning or (with ``persist``) no click from i + 1 on; a click ends the question, so
    satisfaction after a click does not enter.
    """
    none_after = 1.0
    for d in reversed(list(ids)):
        c = user.click_relevant if grades.get(d, 0) > 0 else user.click_other
        none_after = (1.0 - c) * ((1.0 - user.persist) + user.persist * none_after)
    return 1.0 - none_after


class _Coins:
    """A scripted coin for :func:`team_draft`: the ``i``-th toss reads bit ``i`` of ``bits``."""

    def __init__(self, bits: int) -> None:
        self.bits, self.i = bits, 0

    def random(self) -> float:
        v = 0.25 if (self.bits >> self.i) & 1 else 0.75
        self.i += 1
        return v


def _outcome_odds(shown: Interleaving, grades: dict[str, int], user: CascadeUser) -> tuple[float, float]:
    """(P(candidate wins), P(control wins)) of one interleaved list, exact under the cascade user:
    the distribution of (candidate clicks - control clicks) carried down the list."""
    active: dict[int, float] = {0: 1.0}
    done: dict[int, float] = {}

    def add(d: dict[int, float], k: int, p: float) -> None:
        d[k] = d.get(k, 0.0) + p
    for doc, team in zip(shown.ids, shown.teams):
        rel = grades.get(doc, 0) > 0
        c = user.click_relevant if rel else user.click_other
        step = 1 if team == CANDIDATE else -1
        nxt: dict[int, float] = {}
        for diff, p in active.items():
            add(nxt, diff, p * (1 - c) * user.persist)
            add(done, diff, p * (1 - c) * (1 - user.persist))
            clicked = p * c
            if rel:
                add(done, diff + step, clicked * user.satisfy)
                clicked *= 1 - user.satisfy
            add(nxt, diff + step, clicked * user.persist)
            add(done, diff + step, clicked * (1 - user.persist))
        active = nxt
    for diff, p in active.items():
        add(done, diff, p)
    return sum(p for d, p in done.items() if d > 0), sum(p for d, p in done.items() if d < 0)


def interleave_outcomes(a: list[list[str]], b: list[list[str]], qrels: list[dict[str, int]], user: CascadeUser,
                        k: int = 10) -> np.ndarray:
    """Mean (P(b wins), P(a wins), P(tie)) over queries, exact: every sequence of the server's
    team-draft coin tosses (at most one per pair of picks) and the cascade user's clicks on each
    interleaved list (the server's :func:`team_draft` and :func:`credit` rules)."""
    tosses = (k + 1) // 2
    total = np.zeros(3)
    for ra, rb, g in zip(a, b, qrels):
        for bits in range(2 ** tosses):
            w, lo = _outcome_odds(team_draft(ra, rb, k, _Coins(bits)), g, user)   # type: ignore[arg-type]
            total += (w, lo, 1 - w - lo)
    return total / (len(qrels) * 2 ** tosses)


def interleave_to_decide(p: np.ndarray, rng: np.random.Generator, min_decided: int, n_looks: int,
                         alpha: float = 0.05) -> int | None:
    """Impressions until the sign test decides at a look (None: not within the last look)."""
    checks = looks(min_decided, n_looks)
    p_decided = p[0] + p[1]
    if p_decided <= 0:
        return None
    wins = losses = impressions = 0
    for look in checks:
        need = look - (wins + losses)
        # Impressions until ``need`` more decided ones: negative binomial; the split of the
        # decided ones into wins and losses: binomial.
        impressions += need + int(rng.negative_binomial(need, p_decided))
        w = int(rng.binomial(need, p[0] / p_decided))
        wins, losses = wins + w, losses + need - w
        if decided(wins, losses, alpha, min_decided, n_looks):
            return impressions
    return None


def ab_to_decide(ctr_a: float, ctr_b: float, rng: np.random.Generator, min_decided: int, n_looks: int,
                 alpha: float = 0.05) -> int | None:
    """Impressions until Fisher's exact test on click-through decides at a look (users split
    at random; the looks count all impressions, as ``qswap bench loop``'s A/B test)."""
    from scipy.stats import fisher_exact
    na = nb = ca = cb = done = 0
    for look in looks(min_decided, n_looks):
        n = look - done
        a = int(rng.binomial(n, 0.5))
        na, nb = na + a, nb + n - a
        ca += int(rng.binomial(a, ctr_a))
        cb += int(rng.binomial(n - a, ctr_b))
        done = look
        if na and nb and fisher_exact([[ca, na - ca], [cb, nb - cb]])[1] < alpha / n_looks:
            return look
    return None


def _quantile(xs: list[int | None], q: float) -> float | None:
    """The ``q`` quantile with undecided runs as +inf (None when the quantile is undecided)."""
    vals = sorted(float("inf") if x is None else float(x) for x in xs)
    if not vals:
        return None
    v = vals[min(len(vals) - 1, int(np.ceil(q * len(vals))) - 1)]
    return None if v == float("inf") else v


def fixed_power(base: list[list[str]], cand: list[list[str]], qrels: list[dict[str, int]], *, seeds: int,
                min_decided: int, n_looks: int, power: float, user: CascadeUser | None = None,
                seed: int = 0) -> dict[str, Any]:
    """Both methods on one pair of rankings: outcome probabilities, then ``seeds`` experiments each."""
    user = user or CascadeUser()
    p = interleave_outcomes(base, cand, qrels, user)
    ctr_base = float(np.mean([click_probability(user, r, g) for r, g in zip(base, qrels)]))
    ctr_cand = float(np.mean([click_probability(user, r, g) for r, g in zip(cand, qrels)]))
    rng = np.random.default_rng(seed)
    inter = [interleave_to_decide(p, rng, min_decided, n_looks) for _ in range(seeds)]
    ab = [ab_to_decide(ctr_base, ctr_cand, rng, min_decided, n_looks) for _ in range(seeds)]

    def summary(xs: list[int | None]) -> dict[str, Any]:
        return {"median": _quantile(xs, 0.5), "at_power": _quantile(xs, power),
                "decided": sum(x is not None for x in xs), "runs": len(xs), "impressions": xs}
    si, sa = summary(inter), summary(ab)
    ratio = {k: (sa[k] / si[k]) if sa[k] and si[k] else None for k in ("median", "at_power")}
    return {"p_candidate_wins": float(p[0]), "p_base_wins": float(p[1]), "p_tie": float(p[2]),
            "ctr_base": ctr_base, "ctr_candidate": ctr_cand, "queries": len(qrels),
            "budget": looks(min_decided, n_looks)[-1], "interleave": si, "ab_ctr": sa, "ab_over_interleave": ratio}
