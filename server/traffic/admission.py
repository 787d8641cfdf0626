"""Bounded admission for the traffic loop's store work (feedback writes, experiment bookkeeping).

Feedback is written by anyone who searched, so it must never take what admin routes and
search need: it runs on its own small thread pool (never the event loop's default executor,
which admin routes use), and at most ``limit`` requests are admitted (running or queued) at a
time; beyond that the answer is 429 with ``Retry-After`` at once, and nothing is changed.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from qswap.errors import OverloadedError

T = TypeVar("T")

#: Threads doing store work: SQLite serialises writers anyway, so more threads only queue.
WORKERS = 2


class Admission:
    """At most ``limit`` calls admitted at a time, run on ``WORKERS`` threads of their own.

    Args:
        name: what is admitted (in the 429's message and the threads' names).
        limit: calls running or waiting at most.
    """

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.admitted = 0   # changed on the event loop only: no lock
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix=f"qswap-{name}")

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the admission's threads, or raise :class:`OverloadedError` (429) when
        ``limit`` calls are admitted already."""
        if self.admitted >= self.limit:
            raise OverloadedError(f"{self.admitted} {self.name} requests are in progress (the limit is {self.limit})",
                                  "retry after the Retry-After seconds")
        self.admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.admitted -= 1

    def close(self) -> None:
        """Finish what was admitted and stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["Admission", "WORKERS"]
