"""The synchronous qswap client (httpx)."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import httpx

from qswap.client import calls
from qswap.answers import EncoderInfo
from qswap.client.routes import Routes
from qswap.errors import DeadlineExceededError

T = TypeVar("T")


class Client(Routes):
    """A qswap server over HTTP; every route is a method (see :class:`~qswap.client.routes.Routes`).

    Answers 429 and 503 are retried after the server's ``Retry-After`` (at most
    ``max_retries`` times, each wait at most ``max_retry_wait`` seconds); other errors raise the
    named error the server answered (:mod:`qswap.errors`).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        token: bearer token (admin token for admin routes, search token if search needs one).
        timeout: seconds one HTTP exchange may take.
        max_retries: retries of a 429/503 answer.
        max_retry_wait: the longest wait before one retry.
        request_timeout: the server-side deadline of each request (``X-Request-Timeout``).
        transport: an httpx transport (tests, proxies).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", token: str | None = None, *,
                 timeout: float = 60.0, max_retries: int = 3, max_retry_wait: float = 30.0,
                 request_timeout: float | None = None, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self._http = httpx.Client(base_url=self.base_url, headers=calls.headers(token, request_timeout),
                                  timeout=timeout, transport=transport)

    def _send(self, call: calls.Call[T]) -> T:
        attempt = 0
        while True:
            try:
                r = self._http.request(call.method, call.path, json=call.json, files=call.files, data=call.data,
                                       params=call.params)
            except httpx.HTTPError as e:
                raise calls.unreachable(self.base_url, e) from None
            if not calls.should_retry(r, attempt, self.max_retries):
                return calls.answer(call, r)
            time.sleep(calls.retry_after(r, attempt, self.max_retry_wait))
            attempt += 1

    def wait_for_verdict(self, ref: str, timeout: float = 600.0, poll_s: float = 0.5) -> EncoderInfo:
        """Poll an encoder until the server's guard has decided (``guard_status`` is no longer
        ``evaluating``).

        Args:
            ref: the encoder (``name@version``).
            timeout: give up after this many seconds (DeadlineExceededError).
            poll_s: seconds between polls.

        Returns:
            The encoder with its verdict (``passed``, ``refused``, ``failed`` or ``unguarded``).
        """
        end = time.monotonic() + timeout
        while True:
            enc = self.encoder(ref)
            if calls.verdict_reached(enc):
                return enc
            if time.monotonic() > end:
                raise DeadlineExceededError(f"no verdict on {ref} within {timeout} s", "wait longer")
            time.sleep(poll_s)

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
