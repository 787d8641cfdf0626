"""When the server's guard runs, and where its verdicts go.

Evaluations run one at a time on the guard's thread (:class:`qswap.guard.evaluator.SentinelGuard`):
a registration queues one; at start, every encoder without a verdict on these sentinels is
queued again. A verdict is written onto the record only if the record still holds the files it
judged (the digest of its files): an encoder deleted and registered again with other files
during its evaluation never receives the old files' verdict.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from qswap.encoders import BASE_KEY
from qswap.errors import QswapError
from qswap.guard import GuardRecord, GuardStatus
from qswap.guard.evaluator import EvaluationCancelled

if TYPE_CHECKING:
    from qswap.server.registry.facade import EncoderRegistry

log = logging.getLogger("qswap.server")


class GuardScheduler:
    """Queues evaluations of a registry's encoders on its guard and stores their verdicts."""

    def __init__(self, registry: "EncoderRegistry", guard: Any) -> None:
        self.registry = registry
        self.guard = guard                      # a qswap.guard.evaluator.SentinelGuard
        self.jobs: dict[str, Future] = {}
        self.stopping = False

    def _versions(self, keys: list[str]) -> dict[str, str]:
        """key -> digest of its files (the base is itself); caller holds the table lock."""
        records = self.registry.table.records
        return {k: records[k].digest if k in records else k for k in keys}

    def schedule(self, key: str) -> Future:
        """Queue the sentinel evaluation of ``key`` on the guard thread."""
        fut = self.guard.submit(lambda: self.evaluate(key))
        with self.registry.table.lock:
            self.jobs[key] = fut
        fut.add_done_callback(lambda f: self.jobs.pop(key, None) if self.jobs.get(key) is f else None)
        return fut

    def start(self) -> None:
        """At start: evaluate encoders that have no verdict on these sentinels (registered on a
        server without sentinels, or interrupted). Their existing aliases keep serving."""
        reg, table = self.registry, self.registry.table
        with table.lock:
            todo = [k for k, r in table.records.items()
                    if r.guard_status in (GuardStatus.UNGUARDED, GuardStatus.EVALUATING, GuardStatus.FAILED)
                    or (r.evaluation.sentinels if r.evaluation else None) != self.guard.fingerprint]
            warm = [BASE_KEY, *sorted({k for k in table.aliases.values() if k != BASE_KEY})]
            versions = self._versions(warm)
            done = [(k, r) for k, r in table.records.items() if k not in todo and r.evaluation]
        self.guard.submit(lambda: self._warm(warm, versions))
        if reg.metrics is not None:
            for k, r in done:
                reg.metrics.export_guard(k, r.evaluation, r.guard_status)
        with reg.admin_lock:
            for key in sorted(todo):
                if table.records[key].guard_status in (GuardStatus.UNGUARDED, GuardStatus.FAILED):
                    table.update(key, guard_status=GuardStatus.EVALUATING)
                self.schedule(key)
        if todo:
            log.info("guard re-evaluating encoders without a verdict on these sentinels", extra={"encoders": todo})

    def _warm(self, keys: list[str], versions: dict[str, str]) -> None:
        reg = self.registry
        for k in keys:
            reg.hold(k)
        try:
            for k in keys:
                reg.ensure_loaded(k)
            self.guard.warm(keys, versions)
        except Exception:   # only a head start: the evaluation encodes what is missing
            log.exception("guard warm-up failed")
        finally:
            for k in keys:
                reg.release(k)

    def evaluate(self, key: str) -> None:
        """The guard job: evaluate ``key`` against base and every aliased encoder, store the verdict."""
        reg, table = self.registry, self.registry.table
        with table.lock:
            if key not in table.records or reg.is_deleting(key):
                return
            against = [BASE_KEY, *sorted({k for k in table.aliases.values()
                                          if k not in (BASE_KEY, key) and k in table.records})]
            # The verdict is about these files: the cache of query embeddings and the final
            # write both name them, so a re-registration with other files never inherits it.
            versions = self._versions([key, *against])
        held = [key, *against]
        for k in held:
            reg.hold(k)
        t0 = time.perf_counter()
        try:
            for k in held:
                reg.ensure_loaded(k)
            record = self.guard.evaluate(key, against, versions)
            status = GuardStatus(record.verdict)
        except EvaluationCancelled:   # shutdown: no verdict stored, the encoder stays 'evaluating'
            log.info("guard evaluation cancelled", extra={"encoder": key})
            return   # (the finally below releases what it held)
        except Exception as e:   # fail closed: an evaluation that breaks leaves the encoder unservable
            log.exception("guard evaluation failed", extra={"encoder": key})
            msg = e.message if isinstance(e, QswapError) else f"{type(e).__name__}: {e}"
            record = GuardRecord(source="server", passed=False, verdict=GuardStatus.FAILED, error=msg, checks=[],
                                 sentinels=self.guard.fingerprint, evaluated_at=time.time())
            status = GuardStatus.FAILED
        finally:
            for k in held:
                reg.release(k)
        record = record.model_copy(update={"encoder_digest": versions[key]})
        if not self.store_verdict(key, versions[key], status, record):
            return
        if reg.metrics is not None:
            reg.metrics.export_guard(key, record, status, time.perf_counter() - t0)
        if status != GuardStatus.PASSED:
            with table.lock:
                aliased = sorted(d for d, k in table.aliases.items() if k == key)
            if aliased:
                log.error("an aliased encoder failed the guard; its aliases keep serving it",
                          extra={"encoder": key, "domains": aliased, "guard_status": status})

    def store_verdict(self, key: str, digest: str, status: GuardStatus, record: GuardRecord) -> bool:
        """Write a verdict onto ``key`` if the record still holds the files it judged; False when
        it was dropped (deleted, re-registered with other files, shutting down)."""
        if self.stopping:
            return False
        table = self.registry.table
        with self.registry.admin_lock:
            with table.lock:
                rec = table.records.get(key)
            if rec is None or rec.digest != digest:
                log.warning("guard verdict dropped: the encoder was deleted or replaced during its evaluation",
                            extra={"encoder": key, "guard_status": status})
                return False
            try:
                table.update(key, guard_status=status, evaluation=record)
            except Exception:
                log.exception("could not store the guard verdict", extra={"encoder": key})
                return False
        return True

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
        with self.registry.table.lock:
            job = self.jobs.get(key)
        if job is not None:
            job.result(timeout)
