"""The synchronous qswap client (httpx)."""

from __future__ import annotations

import time
from typing import Any, Literal, Mapping, Sequence, TypeVar, overload

import httpx

from qswap.answers import DocumentJobInfo, EncoderInfo, UpsertResult
from qswap.client import calls, exchange
from qswap.client.routes import Routes, SyncSender
from qswap.errors import DeadlineExceededError

T = TypeVar("T")


class Client(SyncSender, Routes):
    """A qswap server over HTTP; every route is a method (:mod:`qswap.client.calls` documents
    each one's arguments and answer: ``client.search(...)`` returns a ``SearchResponse``).

    Answers 429 and 503 are retried after the server's ``Retry-After`` (at most
    ``max_retries`` times, each wait at most ``max_retry_wait`` seconds); other errors raise the
    named error the server answered (:mod:`qswap.errors`). No answer at all raises
    :class:`~qswap.errors.UnreachableError` (refused, unknown host) or
    :class:`~qswap.errors.ClientTimeoutError` (taken, not answered within ``timeout``).

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
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self._http = httpx.Client(base_url=self.base_url, headers=exchange.headers(token, request_timeout),
                                  timeout=timeout, transport=transport)

    def _send(self, call: calls.Call[T]) -> T:
        attempt = 0
        while True:
            try:
                r = self._http.request(call.method, call.path, json=call.json, files=call.files, data=call.data,
                                       params=call.params)
            except httpx.HTTPError as e:
                raise exchange.no_answer(self.base_url, e, self.timeout) from None
            if not exchange.should_retry(r, attempt, self.max_retries):
                return exchange.answer(call, r)
            time.sleep(exchange.retry_after(r, attempt, self.max_retry_wait))
            attempt += 1

    @overload
    def upsert_documents(self, documents: Sequence[Mapping[str, Any]], *, wait: Literal[True],
                         timeout: float = ..., poll_s: float = ...) -> UpsertResult: ...

    @overload
    def upsert_documents(self, documents: Sequence[Mapping[str, Any]], *, wait: bool = False,
                         timeout: float = ..., poll_s: float = ...) -> UpsertResult | DocumentJobInfo: ...

    def upsert_documents(self, documents: Sequence[Mapping[str, Any]], *, wait: bool = False,
                         timeout: float = 600.0, poll_s: float = 0.5) -> UpsertResult | DocumentJobInfo:
        """Add or replace documents ``{"id", "text", "metadata"?}`` (admin).

        Args:
            documents: the documents (an id given twice: the last one wins).
            wait: when the server answers with a job (a large upsert, 202), poll it until it is done.
            timeout: with ``wait``, give up after this many seconds (DeadlineExceededError; the job runs on).
            poll_s: with ``wait``, seconds between polls.

        Returns:
            :class:`~qswap.answers.UpsertResult` once written; without ``wait``, a large upsert's
            :class:`~qswap.answers.DocumentJobInfo` (poll it with :meth:`wait_for_job`).
        """
        out = self._send(calls.upsert_documents(documents))
        return self.wait_for_job(out, timeout, poll_s) if wait and isinstance(out, DocumentJobInfo) else out

    def wait_for_job(self, job: DocumentJobInfo | str, timeout: float = 600.0, poll_s: float = 0.5) -> UpsertResult:
        """Poll an upsert job (``GET /v1/documents/jobs/{id}``) until it is done.

        Args:
            job: the job (or its id) an upsert answered.
            timeout: give up after this many seconds (DeadlineExceededError; the job runs on).
            poll_s: seconds between polls.

        Returns:
            The written result. A failed job raises the error it would have been as a direct answer.
        """
        job_id = job if isinstance(job, str) else job.id
        end = time.monotonic() + timeout
        while True:
            done = exchange.job_outcome(self.document_job(job_id))
            if done is not None:
                return done
            if time.monotonic() > end:
                raise DeadlineExceededError(f"upsert job {job_id} not done within {timeout} s",
                                            "wait longer: the job keeps running on the server")
            time.sleep(poll_s)

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
