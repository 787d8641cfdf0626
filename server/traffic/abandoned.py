"""Work a client abandoned: the server's time it took for nothing, owed before its next large request.

A large request (more than one token slice, or document rows: the bulk lane's work) that its
client leaves before the answer is stopped at its next slice, but what ran until then is lost:
a client that sends such requests and hangs up, again and again, keeps the bulk lane (and the
tokenizer) busy without ever reading an answer, and every normal search pays for it in latency.
The client (an anonymous address; the cost gate, :mod:`qswap.server.serving.gate`, trusts an
application with a bearer token) is charged the seconds its abandoned request held the
server, at least ``abandon_wait_s``; until they have passed, its next large request is
refused at the gate with 429 and ``Retry-After``, before any tokenising or forward pass.
Small requests (one slice) are never refused for it, and a client that waits for its answers
never owes anything.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from qswap.errors import OverloadedError

#: Clients remembered at most; beyond, the least recently charged is forgotten (its debt with it).
MAX_CLIENTS = 65536
#: The most a client can owe (seconds): one abandoned request of any size costs at most this wait.
MAX_OWED_S = 30.0


class AbandonedWork:
    """Per client, until when it owes the server for abandoned large requests; changed on the
    event loop only (no lock).

    Args:
        max_clients: clients remembered at most.
        max_owed_s: the longest wait one client can be given.
    """

    def __init__(self, max_clients: int = MAX_CLIENTS, max_owed_s: float = MAX_OWED_S) -> None:
        self.max_clients = max_clients
        self.max_owed_s = max_owed_s
        self._until: OrderedDict[str, float] = OrderedDict()   # client -> monotonic time its debt ends

    def charge(self, client: str, seconds: float, now: float | None = None) -> None:
        """``client`` abandoned a large request that held the server ``seconds``: it owes them,
        after what it owed already (at most ``max_owed_s`` from now).

        Args:
            client: the client (:func:`qswap.server.traffic.impressions.client_of`).
            seconds: how long its request held the server before the client went away.
            now: the monotonic time (default: now).
        """
        now = time.monotonic() if now is None else now
        start = max(self._until.pop(client, now), now)
        self._until[client] = min(start + max(seconds, 0.0), now + self.max_owed_s)
        if len(self._until) > self.max_clients:
            self._until.popitem(last=False)

    def owed(self, client: str, now: float | None = None) -> float:
        """Seconds ``client`` still owes (0.0: none).

        Args:
            client: the client.
            now: the monotonic time (default: now).
        """
        until = self._until.get(client)
        if until is None:
            return 0.0
        now = time.monotonic() if now is None else now
        if until <= now:
            del self._until[client]
            return 0.0
        return until - now

    def refuse(self, owed_s: float) -> OverloadedError:
        """The 429 for a large request from a client that owes ``owed_s`` seconds."""
        return OverloadedError(
            f"this client abandoned a large request (it went away before the answer); its next large "
            f"request is accepted in {owed_s:.1f} s",
            "wait for the answers of large requests (or give them a longer client timeout), and retry after the "
            "Retry-After seconds; requests within one token slice are not held back",
            retry_after=max(1, math.ceil(owed_s)))


__all__ = ["AbandonedWork", "MAX_CLIENTS", "MAX_OWED_S"]
