"""The experiment records: what the capture store keeps about an online comparison, its counters,
and the answer the server gives about it (one typed record from the store to the HTTP answer).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["shadow", "interleave"]
Status = Literal["running", "stopped", "promoted", "rolled_back"]


class ExperimentRecord(BaseModel):
    """One experiment on a domain alias, as the store keeps it (replaced whole on every change)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    domain: str
    mode: Mode
    fraction: float = Field(description="share of the domain's searches in the experiment")
    control: str = Field(description="what the alias pointed at when the experiment started")
    candidate: str
    status: Status = Field(description="running | stopped | promoted | rolled_back")
    started_at: float
    auto_promote_alpha: float | None = None
    min_decided: int = Field(100, description="decided impressions (counted) at auto-promotion's first look")
    min_clients: int = Field(20, description="auto-promotion needs decided feedback from at least this many "
                                             "distinct clients")
    max_per_client: int = Field(10, description="decided feedbacks of one client that count towards "
                                                "auto-promotion at most")
    previous: str | None = Field(None, description="what the alias pointed at before a promotion (rollback)")
    stopped_at: float | None = None
    promoted_at: float | None = None
    promoted_by: Literal["admin", "auto"] | None = None
    rolled_back_at: float | None = None


class ExperimentStats(BaseModel):
    """An experiment's counters in the store."""

    model_config = ConfigDict(frozen=True)

    impressions: int = 0
    wins: int = 0
    losses: int = 0
    ties: int = 0
    clients: int = 0
    counted_wins: int = 0
    counted_losses: int = 0
    shadow_runs: int = 0
    shadow_skipped: int = 0
    overlap_sum: float = 0.0
    latency_ms_sum: float = 0.0


class Experiment(ExperimentRecord):
    """An experiment with its live statistics (the HTTP answer)."""

    impressions: int = Field(description="interleaved impressions served")
    wins: int = Field(description="feedbacks crediting the candidate")
    losses: int = Field(description="feedbacks crediting the control")
    ties: int
    clients: int = Field(description="distinct clients whose feedback decided an impression")
    counted_wins: int = Field(description="wins that count as evidence: at most max_per_client per client")
    counted_losses: int = Field(description="losses that count as evidence: at most max_per_client per client")
    p_value: float = Field(description="two-sided sign test of the counted wins against the counted losses "
                                       "(what auto-promotion reads)")
    shadow_runs: int
    shadow_skipped: int = Field(description="shadow runs not done: the server was busy")
    overlap: float | None = Field(None, description="mean rank-biased overlap of the two top-k lists (shadow)")
    shadow_latency_ms: float | None = None


class ExperimentList(BaseModel):
    experiments: list[Experiment]


__all__ = ["Experiment", "ExperimentList", "ExperimentRecord", "ExperimentStats", "Mode", "Status"]
