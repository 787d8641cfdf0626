"""What the sync and the async client share around one HTTP exchange: headers, the retry rule,
reading an answer into its value or its named error, and the errors of no answer at all."""

from __future__ import annotations

import email.utils
import time
from typing import TypeVar

import httpx

from qswap.answers import DocumentJobInfo, UpsertResult
from qswap.client.calls import Call
from qswap.errors import ClientTimeoutError, QswapError, UnreachableError, error_from_body

T = TypeVar("T")
RETRY_STATUSES = (429, 503)   # overloaded, not ready / draining: the server says when to come back


def headers(token: str | None, request_timeout: float | None) -> dict[str, str]:
    """Default headers: the bearer token and the per-request deadline (``X-Request-Timeout``)."""
    h = {"Authorization": f"Bearer {token}"} if token else {}
    if request_timeout is not None:
        h["X-Request-Timeout"] = str(request_timeout)
    return h


def retry_after(response: httpx.Response, attempt: int, max_wait: float) -> float:
    """How long to wait before retrying a 429/503: the ``Retry-After`` header (seconds or an
    HTTP date), else an exponential back-off (0.5 s, 1 s, 2 s, ...); at most ``max_wait``."""
    value = response.headers.get("retry-after", "").strip()
    wait: float | None = None
    if value:
        try:
            wait = float(value)
        except ValueError:
            when = email.utils.parsedate_to_datetime(value) if value else None
            wait = when.timestamp() - time.time() if when is not None else None
    if wait is None:
        wait = 0.5 * 2 ** attempt
    return min(max(wait, 0.0), max_wait)


def should_retry(response: httpx.Response, attempt: int, max_retries: int) -> bool:
    """A 429 or 503 with retries left."""
    return response.status_code in RETRY_STATUSES and attempt < max_retries


def answer(call: Call[T], response: httpx.Response) -> T:
    """The call's value, or the server's named error (from the one table in :mod:`qswap.errors`)."""
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text.strip()[:300] or response.reason_phrase}
        if isinstance(body, dict) and response.status_code == 429 and "retry_after" not in body:
            try:
                body["retry_after"] = int(float(response.headers.get("retry-after", "1")))
            except ValueError:
                pass
        raise error_from_body(response.status_code, body)
    if call.text:
        return call.read(response.text)
    if response.status_code == 202 and call.accepted is not None:
        return call.accepted(response.json())
    return call.read(response.json())


def no_answer(url: str, e: httpx.HTTPError, timeout: float | None) -> QswapError:
    """The named error of an exchange that got no answer: the server was never reached
    (refused, unknown host, connect timeout) or it took the request and did not answer in time."""
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UnreachableError(f"cannot reach {url}: {e}", "is the server running and the URL right?")
    if isinstance(e, httpx.TimeoutException):
        return ClientTimeoutError(f"{url} took the request but gave no answer within {timeout} s",
                                  "raise the client's timeout, or send less per request; a write may have "
                                  "happened: check before repeating it")
    return UnreachableError(f"the connection to {url} broke: {e!r}", "retry; if it persists, see the server's log")


def job_outcome(job: DocumentJobInfo) -> UpsertResult | None:
    """A finished upsert job's result; None while it runs; its error (the named error it would
    have been as a direct answer) if it failed."""
    if job.status == "done" and job.result is not None:
        return job.result
    if job.status == "failed":
        err = job.error
        raise error_from_body(err.status if err else 500, err.model_dump() if err else {"detail": "job failed"})
    return None
