"""Named errors shared by every package, and THE error table.

Each error carries a message saying what is wrong and a ``hint`` saying what to do. Each class
also carries its HTTP ``status`` and machine-readable ``code``: the server answers an error
with them (``qswap.server.http.errors``) and the client (``qswap.client``) turns an error answer
back into the same class (:func:`error_from_body`). A subclass without its own ``code``
inherits its parent's, so every qswap error maps. The CLI prints them as one line and exits
with status 2.
"""

from __future__ import annotations

from typing import Any, ClassVar


class QswapError(Exception):
    """Base of all qswap errors: ``str(e)`` is the message, ``e.hint`` what to do."""

    status: ClassVar[int] = 400
    code: ClassVar[str] = "error"

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InvalidInputError(QswapError):
    """The caller gave data or options that cannot be used (bad file, bad field, bad value)."""

    status, code = 400, "invalid_input"


class InvalidRequestError(InvalidInputError):
    """The request does not match the API's schema (a missing or mistyped field)."""

    status, code = 422, "validation_error"


class LimitExceededError(InvalidInputError):
    """A request exceeds a configured limit (k, queries per request, documents per request)."""

    status, code = 422, "limit_exceeded"


class UnsupportedMediaTypeError(InvalidInputError):
    """The body's content type is not one the route reads."""

    status, code = 415, "unsupported_media_type"


class NotFoundError(QswapError):
    """A named thing (encoder, bundled model, document, index, route) does not exist."""

    status, code = 404, "not_found"


class ConflictError(QswapError):
    """The request is valid but clashes with current state (already exists, in use)."""

    status, code = 409, "conflict"


class SpaceMismatchError(ConflictError):
    """Two embedding spaces differ: documents and queries from them are not comparable."""

    status, code = 409, "space_mismatch"

    def __init__(self, message: str, field: str, expected: object, got: object, hint: str = "") -> None:
        super().__init__(message, hint)
        self.field = field
        self.expected = expected
        self.got = got


class IntegrityError(QswapError):
    """Stored data is corrupt or tampered with: checksum mismatch, truncated or missing file."""

    status, code = 422, "integrity_error"


class IndexCorruptError(IntegrityError):
    """The index on the serving side is damaged or inconsistent (restore or rebuild it).

    Not the caller's fault, unlike an IntegrityError in an uploaded file: a server error."""

    status, code = 500, "index_corrupt"


class GuardRefusedError(ConflictError):
    """An encoder significantly degrades its sentinel sets and was not registered with force.

    ``guard`` is the evidence (the guard record with its per-sentinel table), when there is one.
    """

    status, code = 409, "guard_refused"

    def __init__(self, message: str, hint: str = "", guard: dict | None = None) -> None:
        super().__init__(message, hint)
        self.guard = guard


class GuardPendingError(ConflictError):
    """The encoder is still being evaluated on the server's sentinels: not servable yet."""

    status, code = 409, "guard_pending"


class UnauthorizedError(QswapError):
    """No or a wrong bearer token."""

    status, code = 401, "unauthorized"


class ForbiddenError(QswapError):
    """The caller may not use this route (admin disabled, insecure mode from a remote address)."""

    status, code = 403, "forbidden"


class MethodNotAllowedError(QswapError):
    """The route exists, the method does not."""

    status, code = 405, "method_not_allowed"


class PayloadTooLargeError(QswapError):
    """The request body exceeds the configured size."""

    status, code = 413, "payload_too_large"


class OverloadedError(QswapError):
    """The admission queue (overall or the encoder's) is full: retry after ``retry_after`` seconds."""

    status, code = 429, "overloaded"

    def __init__(self, message: str, hint: str = "", retry_after: int = 1) -> None:
        super().__init__(message, hint)
        self.retry_after = retry_after


class InsufficientStorageError(QswapError):
    """The server's disk (or the user's quota) is full: a write could not be made, nothing was changed."""

    status, code = 507, "insufficient_storage"


class InternalServerError(QswapError):
    """A bug on the server's side (its log has the details, under the request id)."""

    status, code = 500, "internal_error"


class NotReadyError(QswapError):
    """The index or the default encoder is still loading, or the server is shutting down."""

    status, code = 503, "not_ready"


class IndexUnavailableError(NotReadyError):
    """The index's store (a Milvus server) cannot be reached or did not answer in time: retry
    after ``Retry-After``; a write that got this answer was not acknowledged."""

    status, code = 503, "index_unavailable"


class DeadlineExceededError(QswapError):
    """The request's deadline (``X-Request-Timeout`` or the server default) passed before it ran."""

    status, code = 504, "deadline_exceeded"


class UnreachableError(QswapError):
    """The client could not reach the server at all: connection refused, unknown host, TLS failure.

    Raised by :mod:`qswap.client`, never answered by a server (``status`` 0: no answer came)."""

    status, code = 0, "unreachable"


class ClientTimeoutError(DeadlineExceededError):
    """The server took the request but did not answer within the client's ``timeout``.

    Raised by :mod:`qswap.client`, never answered by a server. Unlike :class:`UnreachableError`
    the request may have run (an upsert may have been written): check before repeating a write."""

    status, code = 0, "client_timeout"


# THE table: every error a qswap server answers, by code. Where several share a status, the
# first one listed is what a bare status (a framework's 404, 405, 413, ...) stands for.
ERRORS: tuple[type[QswapError], ...] = (
    InvalidInputError, InvalidRequestError, LimitExceededError, UnsupportedMediaTypeError, NotFoundError,
    ConflictError, SpaceMismatchError, GuardRefusedError, GuardPendingError, IntegrityError, UnauthorizedError,
    ForbiddenError, MethodNotAllowedError, PayloadTooLargeError, OverloadedError, InternalServerError,
    IndexCorruptError, NotReadyError, IndexUnavailableError, DeadlineExceededError, InsufficientStorageError,
    QswapError,
)
# What the client raises itself when no answer comes (no HTTP status, so not in the table above).
CLIENT_ERRORS: tuple[type[QswapError], ...] = (UnreachableError, ClientTimeoutError)
_BY_CODE: dict[str, type[QswapError]] = {cls.code: cls for cls in ERRORS}


def error_class(code: str | None, status: int) -> type[QswapError]:
    """The class of an error answer: by its code, else by its status, else :class:`QswapError`.

    Args:
        code: the answer's ``error`` field (may be unknown, e.g. from a newer server).
        status: the HTTP status.

    Returns:
        The named error class to raise.
    """
    if code in _BY_CODE:
        return _BY_CODE[code]
    return next((cls for cls in ERRORS if cls.status == status), QswapError)


def error_from_body(status: int, body: Any) -> QswapError:
    """Rebuild the named error of an error answer, in any of the server's dialects: qswap's
    ``{"error": code, "detail", "hint", ...}``, OpenAI's ``{"error": {"message", "code", ...}}``
    or TEI's ``{"error": message, "error_type", "code"}``.

    Args:
        status: the HTTP status of the answer.
        body: its decoded JSON (anything else is read as a bare message).

    Returns:
        The error, with the fields its class carries (``guard``, ``field``/``expected``/``got``,
        ``retry_after`` from the body's ``retry_after`` if the caller put the header there).
    """
    if not isinstance(body, dict):
        body = {"detail": str(body)[:300]}
    hint = str(body.get("hint") or "")
    error = body.get("error")
    if isinstance(error, dict):                # OpenAI's dialect (the /v1/embeddings and /v1/models routes)
        code, message = error.get("code"), str(error.get("message") or "")
        message = message.removesuffix(f" (hint: {hint})") if hint else message
    elif "error_type" in body:                 # TEI's dialect (the /tei/ routes)
        code, message = body.get("code"), str(error or "").removesuffix(f" (hint: {hint})")
    else:
        code, message = error, str(body.get("detail") or body.get("message") or "")
    cls = error_class(code if isinstance(code, str) else None, status)
    message = message or f"HTTP {status}"
    if issubclass(cls, SpaceMismatchError):
        return cls(message, field=str(body.get("field", "")), expected=body.get("expected"),
                   got=body.get("got"), hint=hint)
    if issubclass(cls, GuardRefusedError):
        return cls(message, hint, guard=body.get("guard") if isinstance(body.get("guard"), dict) else None)
    if issubclass(cls, OverloadedError):
        retry = body.get("retry_after")
        return cls(message, hint, retry_after=int(retry) if isinstance(retry, (int, float)) else 1)
    return cls(message, hint)
