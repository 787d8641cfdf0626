"""Shared route helpers: the error responses documented in OpenAPI, and the app state accessor."""

from __future__ import annotations

from typing import Any

from fastapi import Header, Request

from qswap.server.http.errors import documented_errors
from qswap.server.http.compat_models import OpenAIErrorBody, TeiErrorBody
from qswap.server.http.models import ErrorBody
from qswap.server.state import ServerState

# Error statuses a route can answer (bodies are always ErrorBody), from the one error table.
ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody, "description": doc}
                                           for status, doc in sorted(documented_errors().items())}
# The compatibility routes answer errors in their anchor's shape (qswap.server.http.dialects).
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {s: {**r, "model": OpenAIErrorBody} for s, r in ERRORS.items()}
TEI_ERRORS: dict[int | str, dict[str, Any]] = {s: {**r, "model": TeiErrorBody} for s, r in ERRORS.items()}


def state_of(request: Request) -> ServerState:
    """The app's :class:`ServerState` (set by the app factory).

    Args:
        request: the request being served.

    Returns:
        The state, ready or not (health routes read it while the server loads).
    """
    return request.app.state.qs


# Dependencies are ``async def``: FastAPI runs a plain ``def`` one on its thread pool, a thread
# hop per request that showed as the event loop's largest cost under load.
async def ready_state(request: Request) -> ServerState:
    """The app's state once it serves: the one readiness check, a dependency of every route that
    needs the index or an encoder (route-level auth dependencies run before it).

    Args:
        request: the request being served.

    Returns:
        The ready state.

    Raises:
        NotReadyError: (503) the server is loading, failed to load, or is shutting down.
    """
    return ready_state_of(request)


def ready_state_of(request: Request) -> ServerState:
    """:func:`ready_state` called directly (by a dependency that does more than check readiness).

    Raises:
        NotReadyError: (503) the server is not ready.
    """
    state = state_of(request)
    state.require_ready()
    return state


#: The most seconds a request may ask for in ``X-Request-Timeout``.
MAX_REQUEST_TIMEOUT_S = 600
#: The ``X-Request-Timeout`` header (absent, not null), a parameter of every route with a deadline.
TIMEOUT_HEADER: Any = Header(None, gt=0, le=MAX_REQUEST_TIMEOUT_S, description="seconds this request may take, queueing included; "
                             "past it, queued work is dropped and the answer is 504 (default: the server's "
                             "request_timeout_s)")


def timeout_of(request: Request, x_request_timeout: float | None) -> float:
    """The request's deadline in seconds from now: the header's, else the server's default."""
    return x_request_timeout if x_request_timeout is not None else state_of(request).settings.request_timeout_s


async def request_timeout(request: Request, x_request_timeout: float = TIMEOUT_HEADER) -> float:
    """The request's deadline in seconds from now (a dependency of document routes)."""
    return timeout_of(request, x_request_timeout)
