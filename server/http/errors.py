"""The one place where errors become HTTP responses.

Every error leaves the server as ``{"error": code, "detail": message, "hint": ...}`` with a 4xx
status (5xx only for the server's own faults, overload and deadlines). Status and code come
from the error's class, in the one table of named errors (:mod:`qswap.errors`, which the
client reads too); errors raised by the framework (unknown route, wrong method, unreadable or
too large body) become the named error of their status first.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from qswap.atomic import disk_full
from qswap.server.http.dialects import dialect_for, retry_headers, shape_error
from qswap.errors import (ERRORS, GuardRefusedError, InsufficientStorageError, InvalidRequestError, NotReadyError,
                          OverloadedError, QswapError, SpaceMismatchError, error_class)

log = logging.getLogger("qswap.server")

# nginx's "client closed request": logged, never seen by anyone (the connection is gone)
CLIENT_GONE_STATUS = 499


class ClientGoneError(Exception):
    """The client closed the connection before its answer: the request's remaining work was
    dropped (:mod:`qswap.server.serving.admission`). Not an error of the table: nobody reads it."""

    def __init__(self) -> None:
        super().__init__("the client went away before its answer; its remaining work was dropped")

# What each status means, for the OpenAPI responses of every route (the codes are in the table).
_STATUS_DOCS = {
    400: "invalid input (e.g. an unsafe or malformed encoder archive, token ids instead of text)",
    401: "missing or wrong bearer token",
    403: "admin routes (or register-by-path) disabled",
    404: "unknown route, encoder, alias or encoder directory",
    405: "the route does not take this method",
    409: "conflict: space mismatch (names the field), guard refusal, in use",
    413: "request body too large",
    415: "the body's content type is not read here",
    422: "validation error, limit exceeded, or corrupt encoder (integrity)",
    429: "admission queue full: retry after the Retry-After seconds",
    500: "the server's document index is damaged (restore or rebuild it), or a server bug",
    503: "not ready yet (loading) or shutting down",
    504: "the request waited past its deadline (X-Request-Timeout or the server default) and was dropped",
    # a full disk is the server's fault and nothing was changed: the operator frees space, the client retries
    507: "the server's disk or quota is full; nothing was changed (retry once the operator has freed space)",
}

# What to do, for errors raised by the framework (they carry no hint of their own).
_FRAMEWORK_HINTS = {
    400: "send a well-formed body (JSON, or multipart/form-data for an archive upload)",
    404: "see the routes at /docs or /openapi.json",
    405: "see the methods each route takes at /docs or /openapi.json",
    413: "send a smaller body (see the server's max_body_bytes / max_upload_bytes)",
    415: "send application/json (or multipart/form-data where a route takes an upload)",
}


def status_for(exc: QswapError) -> tuple[int, str]:
    """HTTP status and error code of a qswap error (from its class in :mod:`qswap.errors`).

    Args:
        exc: any qswap error.

    Returns:
        ``(status, code)``.
    """
    return type(exc).status, type(exc).code


def documented_errors() -> dict[int, str]:
    """Status -> description, for the OpenAPI responses of every route."""
    statuses = {cls.status for cls in ERRORS}
    return {status: doc for status, doc in _STATUS_DOCS.items() if status in statuses}


def error_body(code: str, detail: str, hint: str | None = None, **extra: Any) -> dict[str, Any]:
    """The JSON body every error response has."""
    body: dict[str, Any] = {"error": code, "detail": detail}
    if hint:
        body["hint"] = hint
    body.update(extra)
    return body


def error_body_of(exc: QswapError, **extra: Any) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Status, JSON body and headers of the response that answers ``exc``.

    Args:
        exc: the named error.
        **extra: more body fields (e.g. ``request_id``).

    Returns:
        ``(status, body, headers or None)``.
    """
    status, code = status_for(exc)
    fields: dict[str, Any] = {}
    if isinstance(exc, SpaceMismatchError):
        fields = {"field": exc.field, "expected": _jsonable(exc.expected), "got": _jsonable(exc.got)}
    elif isinstance(exc, GuardRefusedError) and exc.guard is not None:
        fields = {"guard": exc.guard}   # the per-sentinel table the refusal rests on
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if isinstance(exc, OverloadedError):
        headers = {"Retry-After": str(exc.retry_after)}
    elif status == 503:
        headers = {"Retry-After": "1"}
    return status, error_body(code, exc.message, exc.hint, **fields, **extra), headers


def _respond(request: Request, status: int, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> JSONResponse:
    rid = getattr(request.state, "request_id", None)
    if rid:
        body["request_id"] = rid
    metrics = getattr(getattr(request.app.state, "qs", None), "metrics", None)
    if metrics is not None:
        metrics.errors.labels(code=body["error"], status=str(status)).inc()
    headers = {**retry_headers(status, body["error"]), **(headers or {})}
    return JSONResponse(shape_error(dialect_for(request.scope["path"]), status, body), status_code=status,
                        headers=headers)


def storage_error(exc: BaseException) -> InsufficientStorageError | None:
    """The 507 error for an exception a full disk caused (any library's dialect), else None."""
    if isinstance(exc, InsufficientStorageError):
        return exc
    if not disk_full(exc):
        return None
    path = _failed_path(exc)
    # The operator's question is what needed the space: say it in the log (the answer stays generic).
    log.warning("disk full: a write failed", extra={"path": path, "writing": _what_needed_space(path),
                                                    "error": f"{type(exc).__name__}: {exc}"})
    return InsufficientStorageError("the server's disk is full: the change was not made",
                                    "free disk space on the server (state dir, index), then retry")


def _failed_path(exc: BaseException | None) -> str | None:
    """The file named by the first OSError in ``exc``'s chain (None when no error names one)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.filename:
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None


def _what_needed_space(path: str | None) -> str:
    """What a write to ``path`` was for, in the operator's words."""
    if path is None:
        return "unknown (the library did not name the file; see the error)"
    parts = path.replace("\\", "/").split("/")
    if "onnx" in parts:
        return "an ONNX export (the first use of an encoder, or of the document tower by the first upsert)"
    if "feedback" in path or path.endswith((".sqlite", ".sqlite-wal", ".db", ".db-wal")):
        return "the feedback capture store"
    if "encoders" in parts or any(p.startswith(".upload-") for p in parts):
        return "an encoder registration (its stored copy)"
    return "the document index or the registry (see path)"


async def _qswap_error(request: Request, exc: QswapError) -> JSONResponse:
    exc = storage_error(exc) or exc   # e.g. an index error raised from a full disk
    status, body, headers = error_body_of(exc)
    log.info("request refused", extra={"status": status, "error": body["error"], "detail": exc.message})
    return _respond(request, status, body, headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
               "type": str(e.get("type", ""))} for e in exc.errors()]
    detail = "; ".join(f"{'.'.join(e['loc'][1:] if e['loc'][:1] == ['body'] else e['loc']) or 'body'}: "
                       f"{e['msg']}" for e in errors[:5]) or "invalid request"
    status, body, _ = error_body_of(InvalidRequestError(detail, "see the request schema at /docs or /openapi.json"),
                                    errors=errors)
    return _respond(request, status, body)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # The framework's own refusals (404 route, 405 method, 400 unreadable body, 413 from the
    # body limit) become the named error of their status, answered like any other.
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 400 and isinstance(exc.__cause__, ClientDisconnect):
        # The body stopped arriving: the request was not bad. Behind Ray Serve's proxy this is a
        # request the proxy re-sent to another replica after the first one died holding its body.
        named: QswapError = NotReadyError("the request body did not arrive in full (the connection or a proxy "
                                          "in front of the server dropped it)", "retry the request")
        _, body, headers = error_body_of(named)
        return _respond(request, 503, body, headers)
    named = error_class(None, exc.status_code)(detail, _FRAMEWORK_HINTS.get(exc.status_code,
                                                                            "see the API description at /docs"))
    _, body, headers = error_body_of(named)
    headers = {**(headers or {}), **dict(exc.headers or {})} or None
    return _respond(request, exc.status_code, body, headers)


async def _write_error(request: Request, exc: Exception) -> JSONResponse:
    """A library's write error: 507 when a full disk caused it; anything else is a bug (500)."""
    full = storage_error(exc)
    if full is None:
        raise exc
    return await _qswap_error(request, full)


async def _client_gone(request: Request, exc: ClientGoneError) -> Response:
    log.info("client went away: its remaining work was dropped", extra={"status": CLIENT_GONE_STATUS})
    return Response(status_code=CLIENT_GONE_STATUS)


def _jsonable(v: object) -> object:
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type to its JSON error response."""
    app.add_exception_handler(QswapError, _qswap_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientGoneError, _client_gone)  # type: ignore[arg-type]
    for write_error in (OSError, sqlite3.Error, RuntimeError):
        app.add_exception_handler(write_error, _write_error)  # type: ignore[arg-type]
    # Anything else is a bug: RequestContextMiddleware (qswap.server.http.logs) logs it and answers
    # the one JSON 500, with the request id.
