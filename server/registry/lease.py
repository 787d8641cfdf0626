"""One lease type for "this request / job / evaluation holds encoder K".

A :class:`Lease` is taken when a reference is acquired (the registry's :meth:`lease` for a
request, :meth:`held` for the guard's own use; a Ray encoder replica's multiplexed LRU holds
one per loaded encoder) and gives it back exactly once, when the last of its holders is done:

- the owner releases its share with :meth:`Lease.release` or by leaving a ``with`` block;
- work the owner hands on (a batch job that finishes on the worker thread) takes a share with
  :meth:`Lease.share` and calls the function it gets once it is done;
- every release is idempotent (a second call does nothing), and ``release_on_collect`` makes
  the garbage collector release a lease that is simply dropped (Ray Serve's LRU eviction).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("qswap.server")


class _Share:
    """One holder's part of a lease: calling it releases that part, once."""

    def __init__(self, lease: "Lease") -> None:
        self._lease: Lease | None = lease
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease._drop()


class Lease:
    """A held reference to encoder ``key``; see the module docstring.

    Args:
        key: the exact encoder key held.
        release: gives the reference back (runs once, on whichever thread drops the last share).
        release_on_collect: release when the lease is garbage-collected unreleased.
    """

    def __init__(self, key: str, release: Callable[[], None], *, release_on_collect: bool = False) -> None:
        self.key = key
        self._release = release
        self._holders = 1
        self._lock = threading.Lock()
        self._own_released = False   # a flag, not a _Share: no cycle, so a dropped lease is collected at once
        self._on_collect = release_on_collect

    @property
    def released(self) -> bool:
        """True once every share is given back (the reference is released)."""
        with self._lock:
            return self._holders == 0

    def share(self) -> Callable[[], None]:
        """Another holder of the same reference (a job the owner hands on).

        Returns:
            Its release: call it once the holder is done (further calls do nothing).

        Raises:
            RuntimeError: the lease is released already (nothing left to share).
        """
        with self._lock:
            if self._holders == 0:
                raise RuntimeError(f"the lease on {self.key} is released; take a new one")
            self._holders += 1
        return _Share(self)

    def release(self) -> None:
        """Give back the owner's share (idempotent); the reference goes with the last share."""
        with self._lock:
            if self._own_released:
                return
            self._own_released = True
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._release()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_on_collect", False) and not self.released:
            try:
                self.release()
            except Exception:  # noqa: BLE001 - never raise from a collector
                log.exception("releasing a dropped lease failed", extra={"encoder": self.key})
