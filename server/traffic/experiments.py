"""Online comparison on a domain alias: shadow runs and team-draft interleaving, then promotion.

An experiment pits a **candidate** encoder against the encoder a domain alias points to (the
**control**) on a fraction of that domain's searches:

- ``shadow``: the response is the control's; afterwards, only when the batch worker is idle,
  the candidate runs the same queries off the response path, and the server records the top-k
  rank-biased overlap and the candidate's latency;
- ``interleave``: both encoders run in the same batch (mixed-encoder batching), the user gets
  a team-draft interleaving of the two lists, and feedback clicks credit the encoder that
  contributed the clicked document; wins and losses feed a two-sided sign test.

Experiments are stored in the feedback store (one SQLite file, shared by Ray replicas over
shared storage), so they need ``--feedback-dir``. Which encoders may be a candidate, be promoted
or be rolled back to is the serving gate's answer (:mod:`qswap.server.registry.serving`): a
candidate must pass the guard on its own (never by force). Promotion is an atomic alias switch
through the registry; the previous target is kept for rollback. Auto-promotion reads only the
evidence the store counts: decided feedback from at least ``min_clients`` distinct clients, at
most ``max_per_client`` outcomes each.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from qswap.errors import ConflictError, InvalidInputError, NotFoundError, QswapError
from qswap.feedback.interleave import (CANDIDATE, CONTROL, credit, decided, rank_biased_overlap, sign_test,
                                       team_draft)
from qswap.feedback.experiment import Experiment, ExperimentRecord
from qswap.feedback.interleave import Interleaving
from qswap.feedback.store import FeedbackStore, ShadowRun
from qswap.server.registry.serving import Use

log = logging.getLogger("qswap.server")

MODES = ("shadow", "interleave")
#: Shadow runs may take at most this share of wall time (over the last SHADOW_WINDOW_S seconds):
#: on a busy machine every shadow forward pass competes with live traffic for the cores, so the
#: share, not only idleness, bounds what shadowing can add to live latency.
SHADOW_SHARE = 0.05
SHADOW_WINDOW_S = 10.0


@dataclass(frozen=True)
class Arm:
    """What an experiment does to one admitted search."""

    experiment: str
    domain: str
    mode: str
    control: str
    candidate: str


def _unit(request_id: str, salt: str) -> float:
    """A uniform number in [0, 1) from the request id: which requests join is reproducible."""
    h = hashlib.sha256(f"{salt}:{request_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


class Experiments:
    """The experiments of one server (or of every Ray replica sharing the feedback store).

    Args:
        store: the feedback store that keeps experiments and their counters.
        registry: the encoder registry (aliases, resolution, promotion).
        refresh_s: how often the experiment table is re-read from the store (other replicas).
    """

    def __init__(self, store: FeedbackStore, registry: Any, metrics: Any = None, refresh_s: float = 0.5) -> None:
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self.refresh_s = refresh_s
        self._table: dict[str, ExperimentRecord] = store.experiments() or {}
        self._read_at = time.monotonic()
        self._lock = threading.Lock()
        self._shadows = 0
        self._shadow_cv = threading.Condition()
        self._shadow_spent: deque[tuple[float, float]] = deque()   # (ended, seconds) of recent shadow runs

    # -- the table -----------------------------------------------------------------------------

    def _current(self) -> dict[str, ExperimentRecord]:
        """The table as the request path sees it: re-read every ``refresh_s`` (other replicas'
        changes), never waiting for the store's writer (the last table serves meanwhile)."""
        if time.monotonic() - self._read_at > self.refresh_s:
            table = self.store.experiments(wait=False)
            if table is not None:
                self._table = table
                self._read_at = time.monotonic()
        return self._table

    def _reload(self) -> None:
        self._table = self.store.experiments() or {}
        self._read_at = time.monotonic()

    def get(self, domain: str) -> Experiment:
        """A domain's experiment with its live statistics (raises :class:`NotFoundError`)."""
        return self.view(self._require(domain))

    def list(self) -> list[Experiment]:
        """Every experiment with its statistics."""
        self._reload()
        return [self.view(d) for _, d in sorted(self._table.items())]

    def view(self, rec: ExperimentRecord) -> Experiment:
        """An experiment with its counters, p-value (of the counted evidence) and mean overlap."""
        st = self.store.stats(rec.id)
        runs = st.shadow_runs
        out = Experiment(**rec.model_dump(), **st.model_dump(exclude={"overlap_sum", "latency_ms_sum"}),
                         p_value=sign_test(st.counted_wins, st.counted_losses),
                         overlap=st.overlap_sum / runs if runs else None,
                         shadow_latency_ms=st.latency_ms_sum / runs if runs else None)
        self._export(out)
        return out

    def _export(self, v: Experiment) -> None:
        m = self.metrics
        if m is None or not hasattr(m, "experiment_impressions"):
            return
        d = v.domain
        m.experiment_impressions.labels(domain=d).set(v.impressions)
        for outcome in ("wins", "losses", "ties"):
            m.experiment_outcomes.labels(domain=d, outcome=outcome).set(getattr(v, outcome))
        m.experiment_p_value.labels(domain=d).set(v.p_value)
        m.experiment_shadow_runs.labels(domain=d).set(v.shadow_runs)
        if v.overlap is not None:
            m.experiment_overlap.labels(domain=d).set(v.overlap)

    # -- admin ---------------------------------------------------------------------------------

    def start(self, domain: str, candidate: str, mode: str, fraction: float,
              auto_promote_alpha: float | None = None, min_decided: int = 100, min_clients: int = 20,
              max_per_client: int = 10) -> Experiment:
        """Start an experiment on a domain alias (one running experiment per domain).

        Args:
            domain: an existing domain alias; its current target is the control.
            candidate: the encoder to compare (``name`` or ``name@version``), servable now.
            mode: ``shadow`` or ``interleave``.
            fraction: share of the domain's searches that take part, in (0, 1].
            auto_promote_alpha: promote on its own once the candidate is ahead and the sign test is
                significant at this level, tested only at ``min_decided`` x 1, 2, 4, ... 512 decided
                impressions, each look at alpha / 10 (:func:`qswap.feedback.interleave.decided`), so
                repeated looks do not inflate the false-alarm rate.
            min_decided: decided impressions (counted wins + losses) at the first look.
            min_clients: auto-promotion needs decided feedback from this many distinct clients.
            max_per_client: decided outcomes of one client that count as evidence at most.

        Returns:
            The experiment as :meth:`view` shows it.
        """
        if mode not in MODES:
            raise InvalidInputError(f"unknown experiment mode {mode!r}", f"use one of {', '.join(MODES)}")
        with self._lock:
            self._reload()
            running = self._table.get(domain)
            if running is not None and running.status == "running":
                raise ConflictError(f"domain {domain!r} already runs experiment {running.id}",
                                    f"stop it first (POST /v1/experiments/{domain}/stop)")
            control = self.registry.aliases().get(domain)
            if control is None:
                raise NotFoundError(f"no domain alias {domain!r}", "an experiment runs on a domain alias: "
                                    "create it with PUT /v1/aliases/{domain}")
            cand = self.registry.acquire(encoder=candidate, use=Use.CANDIDATE)   # the gate, or a clear 4xx
            self.registry.release(cand)
            if cand == control:
                raise InvalidInputError(f"the candidate {cand} is what domain {domain!r} already serves",
                                        "compare another encoder")
            rec = ExperimentRecord(id=uuid.uuid4().hex[:12], domain=domain, mode=mode, fraction=fraction,
                                   control=control, candidate=cand, status="running", started_at=time.time(),
                                   auto_promote_alpha=auto_promote_alpha, min_decided=min_decided,
                                   min_clients=min_clients, max_per_client=max_per_client,
                                   previous=running.previous if running is not None else None)
            self._put(rec)
        log.info("experiment started", extra={"domain": domain, "experiment": rec.id, "mode": mode,
                                              "control": control, "candidate": cand})
        return self.view(rec)

    def stop(self, domain: str) -> Experiment:
        """Stop a domain's experiment (its record and statistics stay visible)."""
        with self._lock:
            rec = self._require(domain).model_copy(update={"status": "stopped", "stopped_at": time.time()})
            self._put(rec)
        return self.view(rec)

    def promote(self, domain: str, reason: str = "admin") -> Experiment:
        """Point the domain at the candidate (atomic alias switch) and end the experiment.

        Refused (409) when the serving gate does not allow the candidate to be promoted (its
        guard did not pass on its own: forced, refused, evaluating), or when the alias no longer
        points at the control (checked under the registry's admin lock).
        """
        with self._lock:
            rec = self._require(domain)
            if rec.status == "promoted":
                raise ConflictError(f"experiment {rec.id} was already promoted", "start a new experiment")
            try:
                self.registry.set_alias(domain, rec.candidate, use=Use.PROMOTE, expect=rec.control)
            except ConflictError as e:
                if e.code != "conflict":   # the gate's refusal (guard_refused, guard_pending) as it is
                    raise
                raise ConflictError(f"domain {domain!r} no longer points at the control {rec.control}",
                                    "the alias changed during the experiment: stop it and start a new one") from e
            rec = rec.model_copy(update={"status": "promoted", "promoted_at": time.time(), "promoted_by": reason,
                                         "previous": rec.control})
            self._put(rec)
        log.info("experiment promoted", extra={"domain": domain, "experiment": rec.id,
                                               "encoder": rec.candidate, "by": reason})
        return self.view(rec)

    def rollback(self, domain: str) -> Experiment:
        """Point the domain back at the encoder it served before the promotion (refused when an
        admin pointed the alias elsewhere since)."""
        with self._lock:
            rec = self._require(domain)
            if rec.status != "promoted" or not rec.previous:
                raise ConflictError(f"experiment {rec.id} on {domain!r} was not promoted",
                                    "rollback undoes a promotion")
            self.registry.set_alias(domain, rec.previous, use=Use.ROLLBACK, expect=rec.candidate)
            rec = rec.model_copy(update={"status": "rolled_back", "rolled_back_at": time.time()})
            self._put(rec)
        return self.view(rec)

    def _put(self, rec: ExperimentRecord) -> None:
        self.store.put_experiment(rec)
        self._reload()

    def _require(self, domain: str) -> ExperimentRecord:
        self._reload()
        rec = self._table.get(domain)
        if rec is None:
            raise NotFoundError(f"no experiment on domain {domain!r}", "start one with POST /v1/experiments")
        return rec

    # -- traffic -------------------------------------------------------------------------------

    def spawn_shadow(self, arm: Arm, control_ids: list[list[str]], run: Callable[[], Any], idle: bool) -> None:
        """Run the candidate off the response path (a task on the running loop) and record its
        overlap with the control's lists and its latency; skipped (and counted) unless ``idle``."""
        now = time.monotonic()
        while self._shadow_spent and self._shadow_spent[0][0] < now - SHADOW_WINDOW_S:
            self._shadow_spent.popleft()
        spent = sum(d for _, d in self._shadow_spent)
        if not idle or spent > SHADOW_SHARE * SHADOW_WINDOW_S:
            # Busy, or shadow runs already took their share of the worker's time: skip (counted).
            self.store.record([ShadowRun(arm.experiment, None)])
            return
        with self._shadow_cv:
            self._shadows += 1

        async def go() -> None:
            t0 = time.monotonic()
            try:
                await _shadow_run(arm, control_ids, run, self.store)
            finally:
                self._shadow_spent.append((time.monotonic(), time.monotonic() - t0))
                with self._shadow_cv:
                    self._shadows -= 1
                    self._shadow_cv.notify_all()
        asyncio.get_running_loop().create_task(go())

    def wait_shadows(self, timeout: float | None = None) -> bool:
        """Block until no shadow run is in flight (False on timeout); for shutdown and tests."""
        with self._shadow_cv:
            return self._shadow_cv.wait_for(lambda: self._shadows == 0, timeout)

    def assign(self, domain: str | None, request_id: str) -> Arm | None:
        """The experiment arm of an admitted search, or ``None`` (no experiment, or not drawn)."""
        if domain is None:
            return None
        rec = self._current().get(domain)
        if rec is None or rec.status != "running":
            return None
        if _unit(request_id, rec.id) >= rec.fraction:
            return None
        return Arm(rec.id, domain, rec.mode, rec.control, rec.candidate)

    def evidence_cap(self, experiment: str | None) -> int | None:
        """Decided outcomes one client may add to ``experiment``'s evidence (its ``max_per_client``)."""
        rec = next((r for r in self._current().values() if r.id == experiment), None)
        return rec.max_per_client if rec is not None else None

    def credit_feedback(self, experiment: str | None, shown: Interleaving | None, clicks: list[str]) -> int | None:
        """The interleaving outcome of a feedback (None when the impression was not interleaved)."""
        if experiment is None or shown is None:
            return None
        return credit(shown, clicks)

    def after_outcome(self, domain: str | None) -> None:
        """Auto-promote a domain's experiment once its counted evidence decides for the candidate:
        feedback from at least ``min_clients`` distinct clients, at most ``max_per_client``
        decided outcomes of each, and the sign test decided at one of its looks."""
        if domain is None:
            return
        rec = self._current().get(domain)
        if rec is None or rec.status != "running" or not rec.auto_promote_alpha:
            return
        st = self.store.stats(rec.id)
        wins, losses = st.counted_wins, st.counted_losses
        if st.clients < rec.min_clients:
            return
        if wins > losses and decided(wins, losses, rec.auto_promote_alpha, rec.min_decided):
            try:
                self.promote(domain, reason="auto")
            except QswapError as e:   # e.g. the candidate's guard did not pass: keep running, say why
                log.warning("auto-promotion refused", extra={"domain": domain, "error": str(e)})


def interleave_hits(control: list[Any], candidate: list[Any], k: int, seed: str) -> tuple[list[Any], list[str]]:
    """Team-draft interleave two hit lists (objects with ``.id``); returns hits and their teams."""
    by_id: dict[str, Any] = {}
    for h in candidate:
        by_id.setdefault(h.id, h)
    for h in control:   # a document both lists hold shows the control's score
        by_id[h.id] = h
    rng = random.Random(seed)
    mixed = team_draft([h.id for h in control], [h.id for h in candidate], k, rng)
    return [by_id[i] for i in mixed.ids], mixed.teams


async def _shadow_run(arm: Arm, control_ids: list[list[str]], run: Callable[[], Any], store: FeedbackStore) -> None:
    t0 = time.perf_counter()
    try:
        out = await run()
    except QswapError as e:   # overloaded, deadline, encoder gone: a skipped shadow, not an error
        log.info("shadow run skipped", extra={"experiment": arm.experiment, "error": str(e)})
        store.record([ShadowRun(arm.experiment, None)])
        return
    latency_ms = (time.perf_counter() - t0) * 1000
    overlaps = [rank_biased_overlap(a, [h.id for h in b]) for a, b in zip(control_ids, out.hits)]
    overlap = sum(overlaps) / len(overlaps) if overlaps else 1.0
    store.record([ShadowRun(arm.experiment, overlap, latency_ms)])


__all__ = ["Arm", "Experiments", "MODES", "interleave_hits", "CONTROL", "CANDIDATE"]
