"""The regression guard: sentinel sets, paired statistics, the evaluator and its typed record.

Shared by tuning (``qswap tune run`` writes a guard record into the manifest) and the server
(``qswap serve --sentinels`` evaluates every registration itself); it imports neither.
"""

from qswap.guard.record import GuardRecord, PooledZ, RankChange, SentinelCheck
from qswap.guard.status import GuardStatus

__all__ = ["GuardRecord", "GuardStatus", "PooledZ", "RankChange", "SentinelCheck"]
