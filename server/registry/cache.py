"""The loaded encoders: attached to the pool and prepared by the backend, in an LRU under a byte budget.

What a loaded encoder costs is its pool bytes plus what the backend holds for it (the shared
runtime binds a LoRA adapter in place: 0 bytes; a merged ONNX export holds a whole transformer,
~8x a LoRA adapter for e5-small). Beyond the budget the least recently used encoder that is
neither pinned (base, default, aliased) nor in use is detached; it loads again on first use.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

from qswap.encoders import BASE_KEY, EncoderPool
from qswap.encoders.runtime.onnx_export import trim_heap

log = logging.getLogger("qswap.server")


class EncoderCache:
    """Which encoders are attached, and what each costs.

    ``lock`` is the registry's table lock (cheap bookkeeping only); ``load_lock`` serialises
    pool changes (attach, detach), which do model work and never run under ``lock``.
    """

    def __init__(self, pool: EncoderPool, backend: Any, budget: int, lock: threading.RLock,
                 metrics: Any = None) -> None:
        self.pool = pool
        self.backend = backend
        self.budget = budget
        self.lock = lock
        self.load_lock = threading.Lock()
        self.metrics = metrics
        self.loaded: OrderedDict[str, int] = OrderedDict()   # key -> bytes, least recently used first
        self.total = 0   # sum of ``loaded``'s bytes, kept as it changes (no scan per load)

    def __contains__(self, key: str) -> bool:
        with self.lock:
            return key == BASE_KEY or key in self.loaded

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (caller holds ``lock``)."""
        if key in self.loaded:
            self.loaded.move_to_end(key)

    def count(self, key: str) -> None:
        """Count an encoder the pool now holds (caller holds ``load_lock``): prepared by the
        backend first, since what the backend holds depends on how it serves it."""
        self.prepare(key)
        size = self.pool.memory_bytes(key) + self.backend.memory_bytes(key)
        with self.lock:
            self.total += size - self.loaded.get(key, 0)
            self.loaded[key] = size
        if self.metrics is not None:
            self.metrics.loads.inc()

    def evict(self, keep: str, busy: Callable[[], set[str]]) -> None:
        """Detach least recently used encoders that are not in ``busy()`` (pinned or in use)
        until under budget (caller holds ``load_lock``; ``busy`` is called under ``lock``).

        Every load is followed by this call, so the heap is trimmed here: what the load and the
        evictions freed goes back to the OS instead of staying resident (:func:`trim_heap`)."""
        try:
            self._evict(keep, busy)
        finally:
            trim_heap()

    def _evict(self, keep: str, busy: Callable[[], set[str]]) -> None:
        while True:
            with self.lock:
                if self.total <= self.budget:
                    return
                held = busy()
                victim = next((k for k in self.loaded if k != keep and k not in held), None)
                if victim is None:
                    log.warning("loaded encoders exceed the memory budget; nothing can be evicted",
                                extra={"bytes": self.total, "budget": self.budget})
                    return
                self.drop(victim)   # from now on a new request reloads it (after this lock)
            self.detach(victim)
            if self.metrics is not None:
                self.metrics.evictions.inc()
            log.info("encoder evicted", extra={"encoder": victim})

    def forget(self, key: str) -> bool:
        """Stop counting ``key`` (caller holds ``load_lock``, then calls :meth:`detach`)."""
        with self.lock:
            return self.drop(key)

    def drop(self, key: str) -> bool:
        """Stop counting ``key`` (caller holds ``lock``); whether it was counted."""
        size = self.loaded.pop(key, None)
        if size is None:
            return False
        self.total -= size
        return True

    def detach(self, key: str) -> None:
        """Remove ``key`` from the pool and the backend (caller holds ``load_lock``)."""
        if key in self.pool:
            self.pool.remove(key)
        self.discard(key)   # an ONNX session would keep the memory the budget freed

    def prepare(self, key: str) -> None:
        """Let the backend get ready to serve ``key`` (an export failure leaves the pool serving it)."""
        try:
            self.backend.prepare(key)
        except Exception:   # an export failure must not fail the request: the pool still serves
            log.exception("backend prepare failed", extra={"encoder": key})

    def discard(self, key: str) -> None:
        """Let the backend free what it holds for ``key``."""
        try:
            self.backend.discard(key)
        except Exception:
            log.exception("backend discard failed", extra={"encoder": key})
