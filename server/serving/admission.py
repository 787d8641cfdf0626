"""What one request carries through the batch worker: its deadline and whether its client is still there.

A :class:`Ticket` is made once per request (by the cost gate, :mod:`qswap.server.serving.gate`,
for an HTTP request; by the server itself for background work such as upserts and guard
evaluations) and passed with every job the request submits. The batch worker reads the
deadline between slices; when the client goes away, :meth:`Ticket.abandon` fails every job
the request still has queued or running, so the worker drops the rest of it at its next slice
instead of computing an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import time

from qswap.server.http.errors import ClientGoneError


class Ticket:
    """One request's admission: a deadline and the futures it waits on (see the module docstring)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.deadline = time.perf_counter() + timeout_s if timeout_s is not None else float("inf")
        self.gone = False
        self._futures: list[asyncio.Future] = []

    def remaining(self) -> float:
        """Seconds left before the deadline (inf without one)."""
        return self.deadline - time.perf_counter()

    def watch(self, fut: asyncio.Future) -> None:
        """Fail ``fut`` with :class:`ClientGoneError` if the client goes away (event loop side)."""
        if self.gone:
            fut.set_exception(ClientGoneError())
            return
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(fut)

    def abandon(self) -> int:
        """The client went away: fail every job of this request that has not finished (the
        worker skips their remaining slices). Event loop side.

        Returns:
            How many jobs were still running or queued.
        """
        self.gone = True
        n = 0
        for f in self._futures:
            if not f.done():
                f.set_exception(ClientGoneError())
                n += 1
        self._futures.clear()
        return n


def token_slices(tokens: list[int], max_tokens: int | None, max_rows: int | None = None) -> list[tuple[int, int]]:
    """Consecutive row ranges for forward passes: rows x longest row within ``max_tokens`` and
    at most ``max_rows`` rows, at least one row each (a row alone may exceed the bound).

    Args:
        tokens: tokens per row.
        max_tokens: the bound of one forward pass (None: none).
        max_rows: rows per pass at most (None: none).

    Returns:
        ``(lo, hi)`` ranges covering every row, in order.
    """
    out: list[tuple[int, int]] = []
    lo, longest = 0, 0
    for i, t in enumerate(tokens):
        top = max(longest, t)
        n = i - lo + 1
        if i > lo and ((max_tokens is not None and n * top > max_tokens) or (max_rows is not None and n > max_rows)):
            out.append((lo, i))
            lo, top = i, t
        longest = top
    if lo < len(tokens):
        out.append((lo, len(tokens)))
    return out
