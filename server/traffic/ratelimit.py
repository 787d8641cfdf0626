"""A request rate per client: a token bucket per client, refused with 429 after Retry-After.

Feedback is sent by anyone who searched, each request cheap to refuse but not free: a client
sending as fast as it is answered (8 connections, hundreds of forged or replayed feedbacks a
second) costs the event loop its HTTP work even when every answer is a 404. Each client gets
``rate`` requests a second (a burst of one second's worth); beyond that the answer is 429 with
``Retry-After``, sent after a pause of those seconds (at most ``MAX_PAUSE_S``): a client that
ignores ``Retry-After`` and sends again as soon as it is answered is held near the rate instead
of being answered as fast as it sends (the pause is a sleep on the event loop: no thread, no
work).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict

from qswap.errors import OverloadedError

#: Clients remembered at most; beyond, the least recently seen bucket is forgotten (it starts
#: full again: a client can gain one burst by being forgotten, never more).
MAX_CLIENTS = 65536
#: The longest pause before a 429 (a refused request holds its connection this long at most).
MAX_PAUSE_S = 1.0


class ClientRateLimit:
    """Token buckets per client key, changed on the event loop only (no lock).

    Args:
        name: what is limited (in the 429's message).
        rate: requests per second per client; 0 means no limit.
        max_clients: buckets kept at most.
    """

    def __init__(self, name: str, rate: float, max_clients: int = MAX_CLIENTS) -> None:
        self.name = name
        self.rate = rate
        self.burst = max(1.0, rate)
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()   # key -> (tokens, at)

    def take(self, key: str, now: float | None = None) -> float:
        """Take one token of ``key``'s bucket.

        Args:
            key: the client.
            now: the monotonic time (default: now).

        Returns:
            0.0 when the request may go on (a token was taken), else the seconds until the
            bucket holds a token again (nothing was taken).
        """
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait

    async def admit(self, key: str) -> None:
        """Go on, or raise :class:`OverloadedError` (429) after a pause of its ``Retry-After``
        (at most ``MAX_PAUSE_S``).

        Args:
            key: the client (:func:`qswap.server.traffic.impressions.client_of`).

        Raises:
            OverloadedError: ``key`` is over its rate; nothing was done for the request.
        """
        wait = self.take(key)
        if wait == 0.0:
            return
        retry_after = max(1, math.ceil(wait))
        await asyncio.sleep(min(retry_after, MAX_PAUSE_S))
        raise OverloadedError(f"more than {self.rate:g} {self.name} requests a second from this client",
                              "retry after the Retry-After seconds (the server's feedback_rate bounds each client)",
                              retry_after=retry_after)


__all__ = ["MAX_CLIENTS", "MAX_PAUSE_S", "ClientRateLimit"]
