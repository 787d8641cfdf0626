"""When the server's guard runs, and where its verdicts go.

Evaluations run one at a time on the guard's thread (:class:`qswap.guard.evaluator.GuardEvaluator`):
a registration queues one; at start, every encoder without a verdict on these sentinels is
queued again. A verdict is written onto the record only if the record still holds the files it
judged (the digest of its files): an encoder deleted and registered again with other files
during its evaluation never receives the old files' verdict.

The scheduler sees the registry through :class:`GuardHost`, a narrow protocol (what to
evaluate, leases on encoders, where a verdict goes): it imports nothing of the registry and
takes none of its locks.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any, Protocol

from qswap.errors import QswapError
from qswap.guard import GuardRecord, GuardStatus
from qswap.guard.evaluator import EvaluationCancelled
from qswap.server.registry.lease import Lease

log = logging.getLogger("qswap.server")


class GuardHost(Protocol):
    """What the guard scheduler needs of a registry (the registry facade implements it)."""

    metrics: Any

    def held(self, key: str) -> Lease:
        """A lease on ``key`` without a servability check (the guard's own use)."""

    def ensure_loaded(self, key: str) -> None:
        """Attach ``key`` to the pool if it is not."""

    def guard_plan(self, fingerprint: str) -> tuple[list[str], list[str], dict[str, str], list[tuple[str, Any]]]:
        """At start: encoders to evaluate (marked evaluating), encoders to warm, their file
        digests, and the records that keep their verdict."""

    def evaluation_targets(self, key: str) -> tuple[list[str], dict[str, str]] | None:
        """What ``key`` is judged against and every judged file digest; None when it is gone."""

    def write_verdict(self, key: str, digest: str, status: GuardStatus, record: GuardRecord) -> bool:
        """Store a verdict if ``key`` still holds the files judged; False when dropped."""

    def aliases_of(self, key: str) -> list[str]:
        """The domains whose alias points to ``key``."""


class GuardScheduler:
    """Queues evaluations of a registry's encoders on its guard and stores their verdicts."""

    def __init__(self, registry: GuardHost, guard: Any) -> None:
        self.registry = registry
        self.guard = guard                      # a qswap.guard.evaluator.GuardEvaluator
        self.jobs: dict[str, Future] = {}
        self._jobs_lock = threading.Lock()
        self.stopping = False

    def schedule(self, key: str) -> Future:
        """Queue the sentinel evaluation of ``key`` on the guard thread."""
        fut = self.guard.submit(lambda: self.evaluate(key))
        with self._jobs_lock:
            self.jobs[key] = fut
        fut.add_done_callback(lambda f: self._forget_job(key, f))
        return fut

    def _forget_job(self, key: str, fut: Future) -> None:
        with self._jobs_lock:
            if self.jobs.get(key) is fut:
                del self.jobs[key]

    def job(self, key: str) -> Future | None:
        """``key``'s pending evaluation, if any."""
        with self._jobs_lock:
            return self.jobs.get(key)

    def start(self) -> None:
        """At start: evaluate encoders that have no verdict on these sentinels (registered on a
        server without sentinels, or interrupted). Their existing aliases keep serving."""
        reg = self.registry
        todo, warm, versions, done = reg.guard_plan(self.guard.fingerprint)
        self.guard.submit(lambda: self._warm(warm, versions))
        if reg.metrics is not None:
            for k, r in done:
                reg.metrics.export_guard(k, r.evaluation, r.guard_status)
        for key in sorted(todo):
            self.schedule(key)
        if todo:
            log.info("guard re-evaluating encoders without a verdict on these sentinels", extra={"encoders": todo})

    def _warm(self, keys: list[str], versions: dict[str, str]) -> None:
        with ExitStack() as held:
            for k in keys:
                held.enter_context(self.registry.held(k))
            try:
                for k in keys:
                    self.registry.ensure_loaded(k)
                self.guard.warm(keys, versions)
            except Exception:   # only a head start: the evaluation encodes what is missing
                log.exception("guard warm-up failed")

    def evaluate(self, key: str) -> None:
        """The guard job: evaluate ``key`` against base and every aliased encoder, store the verdict."""
        reg = self.registry
        targets = reg.evaluation_targets(key)
        if targets is None:
            return
        # The verdict is about these files: the cache of query embeddings and the final
        # write both name them, so a re-registration with other files never inherits it.
        against, versions = targets
        t0 = time.perf_counter()
        with ExitStack() as held:
            for k in (key, *against):
                held.enter_context(reg.held(k))
            try:
                for k in (key, *against):
                    reg.ensure_loaded(k)
                record = self.guard.evaluate(key, against, versions)
                status = GuardStatus(record.verdict)
            except EvaluationCancelled:   # shutdown: no verdict stored, the encoder stays 'evaluating'
                log.info("guard evaluation cancelled", extra={"encoder": key})
                return   # (leaving the block releases what it held)
            except Exception as e:   # fail closed: an evaluation that breaks leaves the encoder unservable
                log.exception("guard evaluation failed", extra={"encoder": key})
                msg = e.message if isinstance(e, QswapError) else f"{type(e).__name__}: {e}"
                record = GuardRecord(source="server", passed=False, verdict=GuardStatus.FAILED, error=msg, checks=[],
                                     sentinels=self.guard.fingerprint, evaluated_at=time.time())
                status = GuardStatus.FAILED
        record = record.model_copy(update={"encoder_digest": versions[key]})
        if not self.store_verdict(key, versions[key], status, record):
            return
        if reg.metrics is not None:
            reg.metrics.export_guard(key, record, status, time.perf_counter() - t0)
        if status != GuardStatus.PASSED:
            aliased = reg.aliases_of(key)
            if aliased:
                log.error("an aliased encoder failed the guard; its aliases keep serving it",
                          extra={"encoder": key, "domains": aliased, "guard_status": status})

    def store_verdict(self, key: str, digest: str, status: GuardStatus, record: GuardRecord) -> bool:
        """Write a verdict onto ``key`` if the record still holds the files it judged; False when
        it was dropped (deleted, re-registered with other files, shutting down)."""
        if self.stopping:
            return False
        return self.registry.write_verdict(key, digest, status, record)

    def stop(self) -> None:
        """At shutdown: queued evaluations are dropped and a running one stores nothing (it
        would fail on the closing index and record a false 'failed'); a restart evaluates again."""
        self.stopping = True
        self.guard.close()

    def forget(self, key: str) -> None:
        """An encoder was deleted: drop its cached query embeddings and its metrics."""
        self.guard.forget(key)
        if self.registry.metrics is not None:
            self.registry.metrics.unexport_guard(key)

    def wait(self, key: str, timeout: float | None = None) -> None:
        """Block until ``key``'s pending evaluation (if any) is done."""
        job = self.job(key)
        if job is not None:
            job.result(timeout)
