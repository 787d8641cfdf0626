"""The one place where errors become HTTP responses.

Every error leaves the server as ``{"error": code, "detail": message, "hint": ...}`` with a 4xx
status (5xx only for the server's own faults, overload and deadlines). qswap errors map by
class, most specific first, in the one table :data:`ERROR_MAP`; framework errors (unknown
route, wrong method, unreadable body) take their code from it by status.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qswap.atomic import disk_full
from qswap.index.errors import IndexCorruptError
from qswap.errors import (ConflictError, GuardPendingError, GuardRefusedError, InsufficientStorageError, IntegrityError,
                          InvalidInputError, NotFoundError, QswapError, SpaceMismatchError)

log = logging.getLogger("qswap.server")


class LimitExceededError(InvalidInputError):
    """A request exceeds a configured limit (k, queries per request, documents per request)."""


class UnauthorizedError(QswapError):
    """No or a wrong bearer token."""


class ForbiddenError(QswapError):
    """The caller may not use this route (admin disabled, insecure mode from a remote address)."""


class PayloadTooLargeError(QswapError):
    """The request body exceeds the configured size."""


class UnsupportedMediaTypeError(InvalidInputError):
    """The body's content type is not one the route reads."""


class MethodNotAllowedError(QswapError):
    """The route exists, the method does not (raised by the framework; here for the table)."""


class NotReadyError(QswapError):
    """The index or the default encoder is still loading, or the server is shutting down."""


class OverloadedError(QswapError):
    """The admission queue (overall or the encoder's) is full: retry after ``retry_after`` seconds."""

    def __init__(self, message: str, hint: str = "", retry_after: int = 1) -> None:
        super().__init__(message, hint)
        self.retry_after = retry_after


class DeadlineExceededError(QswapError):
    """The request's deadline (``X-Request-Timeout`` or the server default) passed before it ran."""


# THE table: (class, HTTP status, error code, what the status means in the API docs), most
# specific first: the first isinstance match wins. Framework errors (unknown route, wrong method,
# unreadable body) find their code and hint here by status; the OpenAPI responses are made from it.
ERROR_MAP: tuple[tuple[type[QswapError], int, str, str], ...] = (
    # a full disk is the server's fault and nothing was changed: the operator frees space, the client retries
    (InsufficientStorageError, 507, "insufficient_storage",
     "the server's disk or quota is full; nothing was changed (retry once the operator has freed space)"),
    (SpaceMismatchError, 409, "space_mismatch", "conflict: space mismatch (names the field), guard refusal, in use"),
    (GuardRefusedError, 409, "guard_refused", ""),
    (GuardPendingError, 409, "guard_pending", ""),
    (ConflictError, 409, "conflict", ""),
    (NotFoundError, 404, "not_found", "unknown route, encoder, alias or encoder directory"),
    # the server's own index is damaged: not the client's fault, so a server error (with a hint to the operator)
    (IndexCorruptError, 500, "index_corrupt", "the server's document index is damaged (restore or rebuild it)"),
    (IntegrityError, 422, "integrity_error", "validation error, limit exceeded, or corrupt encoder (integrity)"),
    (LimitExceededError, 422, "limit_exceeded", ""),
    (UnsupportedMediaTypeError, 415, "unsupported_media_type", "the body's content type is not read here"),
    (InvalidInputError, 400, "invalid_input", "invalid input (e.g. an unsafe or malformed encoder archive)"),
    (UnauthorizedError, 401, "unauthorized", "missing or wrong bearer token"),
    (ForbiddenError, 403, "forbidden", "admin routes (or register-by-path) disabled"),
    (MethodNotAllowedError, 405, "method_not_allowed", "the route does not take this method"),
    (PayloadTooLargeError, 413, "payload_too_large", "request body too large"),
    (OverloadedError, 429, "overloaded", "admission queue full: retry after the Retry-After seconds"),
    (NotReadyError, 503, "not_ready", "not ready yet (loading) or shutting down"),
    (DeadlineExceededError, 504, "deadline_exceeded",
     "the request waited past its deadline (X-Request-Timeout or the server default) and was dropped"),
    (QswapError, 400, "error", ""),
)

# What to do, for errors raised by the framework (they carry no hint of their own).
_FRAMEWORK_HINTS = {
    400: "send a well-formed body (JSON, or multipart/form-data for an archive upload)",
    404: "see the routes at /docs or /openapi.json",
    405: "see the methods each route takes at /docs or /openapi.json",
    413: "send a smaller body (see the server's max_body_bytes / max_upload_bytes)",
    415: "send application/json (or multipart/form-data where a route takes an upload)",
}


def status_for(exc: QswapError) -> tuple[int, str]:
    """HTTP status and error code of a qswap error (``QswapError`` itself closes the table)."""
    return next((status, code) for cls, status, code, _ in ERROR_MAP if isinstance(exc, cls))


def code_for_status(status: int) -> str:
    """The error code of a status raised by the framework (the table's first entry with it)."""
    return next((code for _, st, code, _ in ERROR_MAP if st == status), "http_error")


def documented_errors() -> dict[int, str]:
    """Status -> description, for the OpenAPI responses of every route."""
    return {status: doc for _, status, _, doc in ERROR_MAP if doc}


def error_body(code: str, detail: str, hint: str | None = None, **extra: Any) -> dict[str, Any]:
    """The JSON body every error response has."""
    body: dict[str, Any] = {"error": code, "detail": detail}
    if hint:
        body["hint"] = hint
    body.update(extra)
    return body


def _respond(request: Request, status: int, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> JSONResponse:
    rid = getattr(request.state, "request_id", None)
    if rid:
        body["request_id"] = rid
    metrics = getattr(getattr(request.app.state, "qs", None), "metrics", None)
    if metrics is not None:
        metrics.errors.labels(code=body["error"], status=str(status)).inc()
    return JSONResponse(body, status_code=status, headers=headers)


def storage_error(exc: BaseException) -> InsufficientStorageError | None:
    """The 507 error for an exception a full disk caused (any library's dialect), else None."""
    if isinstance(exc, InsufficientStorageError):
        return exc
    if not disk_full(exc):
        return None
    return InsufficientStorageError("the server's disk is full: the change was not made",
                                    "free disk space on the server (state dir, index), then retry")


async def _qswap_error(request: Request, exc: QswapError) -> JSONResponse:
    exc = storage_error(exc) or exc   # e.g. an index error raised from a full disk
    status, code = status_for(exc)
    extra: dict[str, Any] = {}
    if isinstance(exc, SpaceMismatchError):
        extra = {"field": exc.field, "expected": _jsonable(exc.expected), "got": _jsonable(exc.got)}
    elif isinstance(exc, GuardRefusedError) and exc.guard is not None:
        extra = {"guard": exc.guard}   # the per-sentinel table the refusal rests on
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if isinstance(exc, OverloadedError):
        headers = {"Retry-After": str(exc.retry_after)}
    elif status == 503:
        headers = {"Retry-After": "1"}
    log.info("request refused", extra={"status": status, "error": code, "detail": exc.message})
    return _respond(request, status, error_body(code, exc.message, exc.hint, **extra), headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
               "type": str(e.get("type", ""))} for e in exc.errors()]
    detail = "; ".join(f"{'.'.join(e['loc'][1:] if e['loc'][:1] == ['body'] else e['loc']) or 'body'}: "
                       f"{e['msg']}" for e in errors[:5]) or "invalid request"
    return _respond(request, 422, error_body("validation_error", detail,
                                             "see the request schema at /docs or /openapi.json",
                                             errors=errors))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = code_for_status(exc.status_code)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    hint = _FRAMEWORK_HINTS.get(exc.status_code, "see the API description at /docs")
    return _respond(request, exc.status_code, error_body(code, detail, hint), dict(exc.headers or {}) or None)


async def _write_error(request: Request, exc: Exception) -> JSONResponse:
    """A library's write error: 507 when a full disk caused it; anything else is a bug (500)."""
    full = storage_error(exc)
    if full is None:
        raise exc
    return await _qswap_error(request, full)


def _jsonable(v: object) -> object:
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type to its JSON error response."""
    app.add_exception_handler(QswapError, _qswap_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    for write_error in (OSError, sqlite3.Error, RuntimeError):
        app.add_exception_handler(write_error, _write_error)  # type: ignore[arg-type]
    # Anything else is a bug: RequestContextMiddleware (qswap.server.logs) logs it and answers
    # the one JSON 500, with the request id.
