"""Team-draft interleaving, click credit and the sign test; rank-biased overlap for shadow runs.

Team-draft interleaving (Radlinski, Kurup & Joachims, CIKM 2008): two rankers take turns, as
captains picking teams, each adding its best document not yet shown; the team with fewer picks
goes next and a coin decides ties. A click credits the team that contributed the document; per
impression the ranker with more credited clicks wins. Over many impressions a two-sided sign
test on wins against losses (ties dropped) says whether one ranker is preferred. Each user sees
one list, so the comparison is paired per query and needs far fewer impressions than an A/B
test of click-through rates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence


#: Team labels recorded per interleaved position: the control (the aliased encoder) and the
#: candidate.
CONTROL, CANDIDATE = "A", "B"


@dataclass(frozen=True)
class Interleaving:
    """An interleaved list: ``ids[i]`` was contributed by team ``teams[i]`` (``A`` or ``B``)."""

    ids: list[str]
    teams: list[str]


def team_draft(a: Sequence[str], b: Sequence[str], k: int, rng: random.Random) -> Interleaving:
    """Interleave two rankings by team draft.

    Args:
        a: the control ranking (document ids, best first).
        b: the candidate ranking.
        k: length of the interleaved list (at most the number of distinct ids).
        rng: the coin for ties (seed it per request for reproducible lists).

    Returns:
        The interleaved ids with the team that contributed each.
    """
    ids: list[str] = []
    teams: list[str] = []
    shown: set[str] = set()
    picks = {CONTROL: 0, CANDIDATE: 0}
    pos = {CONTROL: 0, CANDIDATE: 0}
    lists = {CONTROL: a, CANDIDATE: b}
    limit = min(k, len(set(a) | set(b)))
    while len(ids) < limit:
        if picks[CONTROL] < picks[CANDIDATE]:
            team = CONTROL
        elif picks[CANDIDATE] < picks[CONTROL]:
            team = CANDIDATE
        else:
            team = CONTROL if rng.random() < 0.5 else CANDIDATE
        ranking = lists[team]
        while pos[team] < len(ranking) and ranking[pos[team]] in shown:
            pos[team] += 1
        if pos[team] >= len(ranking):       # this team has nothing left: the other one picks
            team = CANDIDATE if team == CONTROL else CONTROL
            ranking = lists[team]
            while pos[team] < len(ranking) and ranking[pos[team]] in shown:
                pos[team] += 1
            if pos[team] >= len(ranking):
                break
        doc = ranking[pos[team]]
        ids.append(doc)
        teams.append(team)
        shown.add(doc)
        picks[team] += 1
    return Interleaving(ids, teams)


def credit(shown: Interleaving, clicks: Iterable[str]) -> int:
    """The outcome of one interleaved impression.

    Args:
        shown: the interleaved list the user saw.
        clicks: ids the user clicked (ids not in the list are ignored).

    Returns:
        ``+1`` if the candidate's team got more clicks, ``-1`` if the control's did, ``0`` for a
        tie (including no click).
    """
    team_of = dict(zip(shown.ids, shown.teams))
    clicked = set(clicks)
    a = sum(1 for d in clicked if team_of.get(d) == CONTROL)
    b = sum(1 for d in clicked if team_of.get(d) == CANDIDATE)
    return (b > a) - (a > b)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided sign test of candidate wins against losses (ties left out).

    Returns:
        The p-value; 1.0 when there is no decided impression.
    """
    n = wins + losses
    if n == 0:
        return 1.0
    from scipy.stats import binomtest   # here, not at import: scipy.stats costs ~1 s of every server start
    return float(binomtest(wins, n, 0.5, alternative="two-sided").pvalue)


def looks(min_decided: int, n_looks: int = 10) -> list[int]:
    """The sample sizes at which a running comparison is tested: ``min_decided`` doubled each time.

    Testing after every impression and stopping at the first p < alpha ("peeking") would raise
    the false-alarm rate far above alpha; testing only at these looks, each at ``alpha / n_looks``
    (Bonferroni), keeps it at most alpha.
    """
    return [min_decided * 2 ** j for j in range(n_looks)]


def decided(wins: int, losses: int, alpha: float, min_decided: int, n_looks: int = 10) -> bool:
    """Whether the sign test is significant at a look (see :func:`looks`): ``wins + losses`` must
    have just reached a look's size, and p must be below ``alpha / n_looks``."""
    return (wins + losses) in looks(min_decided, n_looks) and sign_test(wins, losses) < alpha / n_looks


def rank_biased_overlap(a: Sequence[str], b: Sequence[str], p: float = 0.9) -> float:
    """Rank-biased overlap of two rankings (Webber, Moffat & Zobel 2010), extrapolated.

    1.0 for identical top lists, 0.0 for disjoint ones; agreement near the top weighs more
    (``p`` is the persistence: 0.9 puts ~86 % of the weight on the top 10).

    Args:
        a: first ranking (ids, best first).
        b: second ranking.
        p: persistence in (0, 1).

    Returns:
        The extrapolated RBO in [0, 1].
    """
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    depth = min(len(a), len(b))
    if depth == 0:
        return 1.0 if len(a) == len(b) else 0.0
    seen_a: set[str] = set()
    seen_b: set[str] = set()
    overlap = 0
    total = 0.0
    for d in range(1, depth + 1):
        x, y = a[d - 1], b[d - 1]
        if x == y:
            overlap += 1
        else:
            overlap += (x in seen_b) + (y in seen_a)
        seen_a.add(x)
        seen_b.add(y)
        total += overlap / d * p ** d
    return float(overlap / depth * p ** depth + (1 - p) / p * total)
