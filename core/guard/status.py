"""The verdict a server's guard gives one encoder."""

from __future__ import annotations

from enum import StrEnum


class GuardStatus(StrEnum):
    """The server's verdict on one encoder (str-valued: files and JSON answers hold the strings)."""

    EVALUATING = "evaluating"                 # queued or running: never served, not even when forced
    PASSED = "passed"                         # no sentinel significantly worse
    REFUSED = "refused"                       # a sentinel significantly worse
    INSUFFICIENT = "insufficient_evidence"    # a sentinel has fewer judged queries left than the minimum
    FAILED = "failed"                         # the evaluation itself broke
    UNGUARDED = "unguarded"                   # the server has no sentinels

    @property
    def servable(self) -> bool:
        """Served without force (``passed``, or ``unguarded``: no guard to pass)."""
        return self in (GuardStatus.PASSED, GuardStatus.UNGUARDED)
