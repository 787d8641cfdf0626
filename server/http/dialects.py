"""Error answers in the dialect of the route's anchor: qswap's own, OpenAI's, or TEI's.

qswap's routes answer ``{"error": code, "detail", "hint"}``. The compatibility routes answer as
the API they imitate, so that its clients show the cause: the official ``openai`` package reads
``body["error"]`` as an object (``message``, ``type``, ``param``, ``code``) and raises an
exception carrying them; TEI's clients (``huggingface_hub``, LlamaIndex) read ``error`` as the
message and ``error_type`` as its kind. The qswap code, hint and extra fields ride along in
every dialect, so :func:`qswap.errors.error_from_body` rebuilds the same named error from any.

Retrying: the ``openai`` package retries every 409, 429 and 5xx unless the answer carries
``x-should-retry``. A verdict that will not change on its own (a refused encoder, a bad request)
says ``false``; a pending guard evaluation says ``true`` with a ``Retry-After``.
"""

from __future__ import annotations

from typing import Any, Literal

Dialect = Literal["qswap", "openai", "tei"]

# Seconds an SDK should wait before asking again for an encoder whose guard is still evaluating.
GUARD_PENDING_RETRY_S = 2

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}
# TEI's error kinds (its ErrorType): what its clients branch on.
_TEI_TYPES = {429: "Overloaded", 503: "Unhealthy"}


def dialect_for(path: str) -> Dialect:
    """The error dialect of a request path.

    Args:
        path: the request's URL path.

    Returns:
        ``"openai"`` for ``/v1/embeddings``, ``/embeddings`` and ``/v1/models...``; ``"tei"`` under
        ``/tei/``; else ``"qswap"``.
    """
    if path in ("/v1/embeddings", "/embeddings") or path == "/v1/models" or path.startswith("/v1/models/"):
        return "openai"
    if path.startswith("/tei/"):
        return "tei"
    return "qswap"


def _message(body: dict[str, Any]) -> str:
    detail, hint = str(body.get("detail", "")), body.get("hint")
    return f"{detail} (hint: {hint})" if hint else detail


def _param(body: dict[str, Any]) -> str | None:
    """The request field an error is about: a validation error's location, or a mismatch's field."""
    errors = body.get("errors")
    if isinstance(errors, list) and errors:
        loc = [p for p in errors[0].get("loc", []) if p != "body"]
        return ".".join(str(p) for p in loc) or None
    return body.get("param") or None


def shape_error(dialect: Dialect, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An error body (qswap's shape) in the dialect of its route.

    Args:
        dialect: from :func:`dialect_for`.
        status: the HTTP status.
        body: ``{"error": code, "detail", "hint", ...extra}``.

    Returns:
        The body to send: qswap's unchanged; OpenAI's ``{"error": {message, type, param, code}}``;
        TEI's ``{"error": message, "error_type"}``; both keep ``code``, ``hint`` and the extras.
    """
    if dialect == "qswap":
        return body
    code, rest = body["error"], {k: v for k, v in body.items() if k not in ("error", "detail")}
    if dialect == "openai":
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": _message(body), "type": kind, "param": _param(body), "code": code}, **rest}
    kind = _TEI_TYPES.get(status, "Backend" if status >= 500 else "Validation")
    return {"error": _message(body), "error_type": kind, "code": code, **rest}


def retry_headers(status: int, code: str) -> dict[str, str]:
    """``x-should-retry`` (and ``Retry-After``) for an error, so SDKs retry only what may change."""
    if code == "guard_pending":
        return {"x-should-retry": "true", "Retry-After": str(GUARD_PENDING_RETRY_S)}
    if 400 <= status < 500 and status not in (408, 429):
        return {"x-should-retry": "false"}
    return {}


__all__ = ["GUARD_PENDING_RETRY_S", "Dialect", "dialect_for", "retry_headers", "shape_error"]
