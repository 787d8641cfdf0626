"""The one place where errors become HTTP responses.

Every error leaves the server as ``{"error": code, "detail": message, "hint": ...}`` with a 4xx
status (5xx only for the server's own faults). qswap errors map by class, most specific first.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qswap.errors import (ConflictError, GuardPendingError, GuardRefusedError, IntegrityError, InvalidInputError,
                          NotFoundError, QswapError, SpaceMismatchError)

log = logging.getLogger("qswap.server")


class LimitExceededError(InvalidInputError):
    """A request exceeds a configured limit (k, queries per request, documents per request)."""


class UnauthorizedError(QswapError):
    """No or a wrong bearer token."""


class ForbiddenError(QswapError):
    """The caller may not use this route (admin disabled, insecure mode from a remote address)."""


class PayloadTooLargeError(QswapError):
    """The request body exceeds the configured size."""


class NotReadyError(QswapError):
    """The index or the default encoder is still loading, or the server is shutting down."""


# (class, HTTP status, error code), most specific first: the first isinstance match wins.
ERROR_MAP: tuple[tuple[type[QswapError], int, str], ...] = (
    (SpaceMismatchError, 409, "space_mismatch"),
    (GuardRefusedError, 409, "guard_refused"),
    (GuardPendingError, 409, "guard_pending"),
    (ConflictError, 409, "conflict"),
    (NotFoundError, 404, "not_found"),
    (IntegrityError, 422, "integrity_error"),
    (LimitExceededError, 422, "limit_exceeded"),
    (InvalidInputError, 400, "invalid_input"),
    (UnauthorizedError, 401, "unauthorized"),
    (ForbiddenError, 403, "forbidden"),
    (PayloadTooLargeError, 413, "payload_too_large"),
    (NotReadyError, 503, "not_ready"),
    (QswapError, 400, "error"),
)

_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 406: "not_acceptable", 413: "payload_too_large",
               415: "unsupported_media_type", 422: "validation_error", 429: "too_many_requests",
               503: "not_ready"}


def status_for(exc: QswapError) -> tuple[int, str]:
    """HTTP status and error code of a qswap error."""
    for cls, status, code in ERROR_MAP:
        if isinstance(exc, cls):
            return status, code
    return 400, "error"


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


async def _qswap_error(request: Request, exc: QswapError) -> JSONResponse:
    status, code = status_for(exc)
    extra: dict[str, Any] = {}
    if isinstance(exc, SpaceMismatchError):
        extra = {"field": exc.field, "expected": _jsonable(exc.expected), "got": _jsonable(exc.got)}
    elif isinstance(exc, GuardRefusedError) and exc.guard is not None:
        extra = {"guard": exc.guard}   # the per-sentinel table the refusal rests on
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 503:
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
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return _respond(request, exc.status_code, error_body(code, detail), dict(exc.headers or {}) or None)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return _respond(request, 500, error_body("internal_error", "internal server error",
                                             "the server logs have the details (search for the request id)"))


def _jsonable(v: object) -> object:
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type to its JSON error response."""
    app.add_exception_handler(QswapError, _qswap_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
