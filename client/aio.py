"""The asynchronous qswap client (httpx): the same methods as :class:`~qswap.client.Client`,
each returning an awaitable."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal, Mapping, Sequence, TypeVar, overload

import httpx

from qswap.answers import DocumentJobInfo, EncoderInfo, UpsertResult
from qswap.client import calls, exchange
from qswap.client.routes import AsyncSender, Routes
from qswap.errors import DeadlineExceededError

T = TypeVar("T")


class AsyncClient(AsyncSender, Routes):
    """A qswap server over HTTP, from asyncio code (``await client.search(...)``).

    Args: as :class:`~qswap.client.Client` (``transport`` an ``httpx.AsyncBaseTransport``).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", token: str | None = None, *,
                 timeout: float = 60.0, max_retries: int = 3, max_retry_wait: float = 30.0,
                 request_timeout: float | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=exchange.headers(token, request_timeout),
                                       timeout=timeout, transport=transport)

    async def _send(self, call: calls.Call[T]) -> T:
        attempt = 0
        while True:
            try:
                r = await self._http.request(call.method, call.path, json=call.json, files=call.files,
                                             data=call.data, params=call.params)
            except httpx.HTTPError as e:
                raise exchange.no_answer(self.base_url, e, self.timeout) from None
            if not exchange.should_retry(r, attempt, self.max_retries):
                return exchange.answer(call, r)
            await asyncio.sleep(exchange.retry_after(r, attempt, self.max_retry_wait))
            attempt += 1

    @overload
    async def upsert_documents(self, documents: Sequence[Mapping[str, Any]], *, wait: Literal[True],
                               timeout: float = ..., poll_s: float = ...) -> UpsertResult: ...

    @overload
    async def upsert_documents(self, documents: Sequence[Mapping[str, Any]], *, wait: bool = False,
                               timeout: float = ..., poll_s: float = ...) -> UpsertResult | DocumentJobInfo: ...

    async def upsert_documents(self, documents: Sequence[Mapping[str, Any]], *, wait: bool = False,
                               timeout: float = 600.0, poll_s: float = 0.5) -> UpsertResult | DocumentJobInfo:
        """As :meth:`qswap.client.Client.upsert_documents`."""
        out = await self._send(calls.upsert_documents(documents))
        return await self.wait_for_job(out, timeout, poll_s) if wait and isinstance(out, DocumentJobInfo) else out

    async def wait_for_job(self, job: DocumentJobInfo | str, timeout: float = 600.0,
                           poll_s: float = 0.5) -> UpsertResult:
        """As :meth:`qswap.client.Client.wait_for_job`."""
        job_id = job if isinstance(job, str) else job.id
        end = time.monotonic() + timeout
        while True:
            done = exchange.job_outcome(await self.document_job(job_id))
            if done is not None:
                return done
            if time.monotonic() > end:
                raise DeadlineExceededError(f"upsert job {job_id} not done within {timeout} s",
                                            "wait longer: the job keeps running on the server")
            await asyncio.sleep(poll_s)

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
