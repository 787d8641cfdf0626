"""The report of one tuning run, typed: what ``report.json`` holds, what ``report.md`` and the
CLI's summary are rendered from, and what :class:`~qswap.tuning.config.RunResult` carries. The
guard verdict is the shared :class:`~qswap.guard.GuardRecord`; training, evaluation and layer
tables stay the plain objects their modules write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from qswap.guard import GuardRecord


class EncoderWritten(BaseModel):
    """The encoder directory the run wrote."""

    name: str
    version: str
    kind: str          # how it is saved (``identity`` when no epoch beat the base)
    path: str


class BaseModelOf(BaseModel):
    """The frozen base model the encoder adapts."""

    name: str
    fingerprint: str
    space: dict[str, Any]


class RunReport(BaseModel):
    """``report.json`` of a tuning run."""

    model_config = ConfigDict(extra="allow")   # report.json of other versions

    encoder: EncoderWritten
    base: BaseModelOf
    method: dict[str, Any]
    loss: dict[str, Any]
    recipe: dict[str, Any] | None = None
    data: dict[str, Any]               # source, splits, split_before_mining, documents, mining, dropped_without_negative
    training: dict[str, Any]           # :meth:`TrainResult.to_dict`: history, best epoch, steps, timings
    evaluation: dict[str, Any]         # test / retrieval comparisons, the language matrix
    guard: GuardRecord
    layers: dict[str, Any] | None = None
    artifact_check: dict[str, Any] | None = None
    query_runtime: dict[str, str] = {}
    tokenised_queries: int = 0
    config: dict[str, Any] = {}
    phases: dict[str, float] = {}      # wall seconds per phase
    wall_seconds_total: float
    cpu_seconds_total: float           # every thread's: less sensitive to a shared machine's load

    def to_dict(self) -> dict[str, Any]:
        """The report as ``report.json`` holds it (its tables may still hold numpy scalars:
        :func:`qswap.tuning.report.write_report` writes them as numbers)."""
        return {**self.model_dump(), "guard": self.guard.to_json()}

    def summary(self) -> str:
        """The few lines ``qswap tune run`` prints."""
        enc, tr, g = self.encoder, self.training, self.guard
        lines = [f"encoder   {enc.path}  ({enc.name}@{enc.version}, kind {enc.kind})",
                 f"training  best epoch {tr['best_epoch']}, stopped by {tr['stopped']}, {tr['steps']} steps, "
                 f"{tr['wall_seconds']:.1f} s"]
        dropped = self.data.get("dropped_without_negative") or {}
        before = self.data.get("split_before_mining") or {}
        if any(dropped.values()):
            total = sum(before.get(k, 0) for k in dropped)
            parts = ", ".join(f"{k} {n} of {before.get(k, 0)}" for k, n in dropped.items() if n)
            lines.append(f"data      {sum(dropped.values())} of {total} queries dropped: no negative left after "
                         f"mining ({parts}; raise --fn-cutoff or use --loss infonce to keep them)")
        for key in ("test", "retrieval"):
            ev = self.evaluation.get(key)
            if ev:
                m, nd = ev["metrics"]["pnd_cos"], ev["metrics"]["ndcg_at_10"]
                z = ev["z_tests"].get("pnd_cos", {})
                imp = "n/a" if m["improvement"] is None else f"{100 * m['improvement']:+.2f}%"
                lines.append(f"{key:9s} PND(cos) {m['base']:.4f} -> {m['tuned']:.4f} (I {imp}, "
                             f"Z {z.get('z', 0):+.2f}); nDCG@10 {nd['base']:.4f} -> {nd['tuned']:.4f}")
        ml = self.evaluation.get("multilingual")
        if ml:
            c = ml["counts"]
            lines.append(f"languages {c['improved']}/{c['worsened']} of {c['pairs']} pairs significantly "
                         "improved/worsened")
        lines.append(f"guard     {'passed' if g.passed else 'FAILED'} ({len(g.checks)} checks)")
        if self.phases:
            lines.append(f"time      {self.wall_seconds_total:.0f} s: "
                         + ", ".join(f"{k} {v:.0f} s" for k, v in self.phases.items()))
        lines.append(f"report    {Path(enc.path) / 'report.md'}")
        return "\n".join(lines)
