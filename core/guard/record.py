"""The guard record, typed: what a guard evaluation found (a manifest's ``guard``, a server
record's ``evaluation``). Stored as JSON; read back through these models, so a reader gets
attributes, not dict keys, and a malformed record is one validation error."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

INSUFFICIENT = "insufficient_evidence"


class SentinelCheck(BaseModel):
    """One sentinel compared against one reference encoder."""

    model_config = ConfigDict(extra="allow")   # the reported tests (rr, pnd, sign test, ...)

    name: str
    against: str = "base"
    lang: str | None = None
    n: int | None = None                 # queries scored
    metric: str | None = None
    before: float | None = None          # mean nDCG@10 under the reference
    after: float | None = None           # ... and under the evaluated encoder
    delta: float | None = None
    p_value: float | None = None
    p_holm: float | None = None          # Holm-adjusted over the sentinels of this reference
    verdict: str | None = None           # unchanged | improved | regressed | insufficient_evidence
    degraded: bool = False
    min_queries: int | None = None

    @property
    def judged(self) -> bool:
        """Whether the check had enough queries to compare anything."""
        return self.verdict != INSUFFICIENT and self.p_holm is not None


class GuardRecord(BaseModel):
    """A guard evaluation: every check and the verdict."""

    model_config = ConfigDict(extra="allow")   # the server's extras: source, sentinels, against, timings

    passed: bool
    verdict: str | None = None           # passed | refused | insufficient_evidence (None: older records)
    alpha: float | None = None
    min_queries: int | None = None
    checks: list[SentinelCheck] = []

    @classmethod
    def of(cls, record: dict[str, Any]) -> "GuardRecord":
        """Read a stored record (raises :class:`pydantic.ValidationError` when malformed)."""
        return cls.model_validate(record)

    def regressed(self) -> list[SentinelCheck]:
        return [c for c in self.checks if c.degraded]

    def insufficient(self) -> list[SentinelCheck]:
        return [c for c in self.checks if c.verdict == INSUFFICIENT]
