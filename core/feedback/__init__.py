"""Learning from live traffic: what users saw and clicked, and how two rankers compare on it.

- :mod:`qswap.feedback.store`: the capture store (impressions and the feedback on them), an
  append-only SQLite file in WAL mode, bounded by size and age.
- :mod:`qswap.feedback.interleave`: team-draft interleaving, click credit, the sign test, and
  rank-biased overlap for shadow runs.
- :mod:`qswap.feedback.export`: captured feedback as a BEIR directory that tuning and
  ``qswap sentinels make`` read (clicked documents relevant, documents skipped above a click
  judged non-relevant, a held-out split of queries).

It sits below the server (which captures) and tuning (which learns), and imports neither.
"""
