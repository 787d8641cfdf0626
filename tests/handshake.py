"""Handshakes for tests that order events across threads: wait for what happened, never for a time."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Counter:
    """A count that threads raise with :meth:`add` and others wait on with :meth:`wait_for`."""

    def __init__(self) -> None:
        self._n = 0
        self._cond = threading.Condition()

    @property
    def value(self) -> int:
        """The count now."""
        with self._cond:
            return self._n

    def add(self, k: int = 1) -> None:
        """Raise the count by ``k`` and wake every waiter."""
        with self._cond:
            self._n += k
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 60.0) -> bool:
        """Block until the count reaches ``n``.

        Args:
            n: the count to wait for.
            timeout: seconds at most (a test's bound, not an ordering: it fails when it passes).

        Returns:
            True once the count reached ``n``; False at the timeout.
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._n >= n, timeout)


def held_first_call(fn: Callable[..., Any], until: Callable[[], bool], timeout: float = 30.0) -> Callable[..., Any]:
    """``fn``, whose first call waits until ``until()`` holds (polled: a state another thread
    changes, e.g. requests queued behind a batch) or ``timeout`` passes; later calls go straight through."""
    first = threading.Event()

    def call(*args: Any, **kw: Any) -> Any:
        if not first.is_set():
            first.set()
            end = time.monotonic() + timeout
            while not until() and time.monotonic() < end:
                time.sleep(0.001)
        return fn(*args, **kw)

    return call
