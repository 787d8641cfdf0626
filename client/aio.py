"""The asynchronous qswap client (httpx): the same methods as :class:`~qswap.client.Client`,
each returning an awaitable."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

import httpx

from qswap.client import calls
from qswap.answers import EncoderInfo
from qswap.client.routes import Routes
from qswap.errors import DeadlineExceededError

T = TypeVar("T")


class AsyncClient(Routes):
    """A qswap server over HTTP, from asyncio code (``await client.search(...)``).

    Args: as :class:`~qswap.client.Client` (``transport`` an ``httpx.AsyncBaseTransport``).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", token: str | None = None, *,
                 timeout: float = 60.0, max_retries: int = 3, max_retry_wait: float = 30.0,
                 request_timeout: float | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=calls.headers(token, request_timeout),
                                       timeout=timeout, transport=transport)

    async def _send(self, call: calls.Call[T]) -> T:  # type: ignore[override]
        attempt = 0
        while True:
            try:
                r = await self._http.request(call.method, call.path, json=call.json, files=call.files,
                                             data=call.data, params=call.params)
            except httpx.HTTPError as e:
                raise calls.unreachable(self.base_url, e) from None
            if not calls.should_retry(r, attempt, self.max_retries):
                return calls.answer(call, r)
            await asyncio.sleep(calls.retry_after(r, attempt, self.max_retry_wait))
            attempt += 1

    async def wait_for_verdict(self, ref: str, timeout: float = 600.0, poll_s: float = 0.5) -> EncoderInfo:
        """As :meth:`qswap.client.Client.wait_for_verdict`."""
        end = time.monotonic() + timeout
        while True:
            enc = await self.encoder(ref)
            if calls.verdict_reached(enc):
                return enc
            if time.monotonic() > end:
                raise DeadlineExceededError(f"no verdict on {ref} within {timeout} s", "wait longer")
            await asyncio.sleep(poll_s)

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
