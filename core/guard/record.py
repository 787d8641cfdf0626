"""The guard record, typed: what a guard evaluation found, from the producer (the checks, the
server's evaluator, a tuning run) to the stored record (a manifest's ``guard``, a server
record's ``evaluation``) to the HTTP answer and the client. Stored as JSON (:meth:`GuardRecord.to_json`)
and read back through these models, so a reader gets attributes, not dict keys, and a malformed
record is one validation error. Fields a record does not have stay ``None``; fields these models
do not name (records of other versions) are kept."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from qswap.guard.status import GuardStatus

INSUFFICIENT = "insufficient_evidence"

#: A check's verdicts: its sentinel under the evaluated encoder against one reference.
CHECK_VERDICTS = ("unchanged", "improved", "regressed", INSUFFICIENT)


class RankChange(BaseModel):
    """The reciprocal rank under both encoders, with the paired tests on it (reported)."""

    model_config = ConfigDict(extra="allow")

    before: float | None = None
    after: float | None = None
    p_value: float | None = None
    sign_p_value: float | None = None
    wins: int | None = None
    losses: int | None = None


class PooledZ(BaseModel):
    """The pooled PND Z-test over every (relevant, non-relevant) pair (reported, never decisive)."""

    model_config = ConfigDict(extra="allow")

    errors_before: int
    errors_after: int
    pairs: int
    z: float | None = None
    change: str | None = None


class SentinelCheck(BaseModel):
    """One sentinel compared against one reference encoder."""

    model_config = ConfigDict(extra="allow")   # fields of records of other versions

    name: str
    against: str = "base"
    lang: str | None = None
    n: int | None = None                 # queries scored
    metric: str | None = None
    before: float | None = None          # mean nDCG@10 under the reference
    after: float | None = None           # ... and under the evaluated encoder
    delta: float | None = None
    statistic: float | None = None       # Wilcoxon signed-rank statistic
    p_value: float | None = None
    p_holm: float | None = None          # Holm-adjusted over the sentinels of this reference
    wins: int | None = None
    losses: int | None = None
    sign_p_value: float | None = None
    t_p_value: float | None = None
    rr: RankChange | None = None
    pnd: PooledZ | None = None
    verdict: str | None = None           # one of CHECK_VERDICTS (a string: records of other versions load)
    degraded: bool = False
    min_queries: int | None = None

    @property
    def judged(self) -> bool:
        """Whether the check had enough queries to compare anything."""
        return self.verdict != INSUFFICIENT and self.p_holm is not None


class GuardRecord(BaseModel):
    """A guard evaluation: every check and the verdict (with the server's facts when the server
    evaluated: source, sentinels, references, timings; ``error`` when the evaluation broke)."""

    model_config = ConfigDict(extra="allow")   # fields of records of other versions

    passed: bool
    verdict: GuardStatus | None = None   # passed | refused | insufficient_evidence | failed (None: older records)
    alpha: float | None = None
    min_queries: int | None = None
    test: str | None = None              # the deciding test
    z_critical: float | None = None
    checks: list[SentinelCheck] = []
    source: str | None = None            # "server" for the server's own evaluation
    sentinels: str | None = None         # fingerprint of the server's sentinels
    against: list[str] | None = None     # reference encoders (base first)
    evaluated_at: float | None = None
    seconds: float | None = None
    encode_seconds: float | None = None
    index_documents: int | None = None
    encoder_digest: str | None = None    # the files the verdict is about
    error: str | None = None             # why the evaluation failed (verdict "failed")

    @classmethod
    def of(cls, record: "GuardRecord | dict[str, Any]") -> "GuardRecord":
        """Read a stored record (raises :class:`pydantic.ValidationError` when malformed)."""
        return record if isinstance(record, GuardRecord) else cls.model_validate(record)

    def to_json(self) -> dict[str, Any]:
        """The record as stored (manifest, registry file) and carried by a refusal: JSON types,
        absent fields left out."""
        return self.model_dump(mode="json", exclude_none=True)

    def regressed(self) -> list[SentinelCheck]:
        return [c for c in self.checks if c.degraded]

    def insufficient(self) -> list[SentinelCheck]:
        return [c for c in self.checks if c.verdict == INSUFFICIENT]
