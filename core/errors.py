"""Named errors shared by every package.

Each error carries a message saying what is wrong and a ``hint`` saying what to do. The
server maps these classes to HTTP status codes in one place (``qswap.server.errors``);
the CLI prints them as one line and exits with status 2.
"""

from __future__ import annotations


class QswapError(Exception):
    """Base of all qswap errors: ``str(e)`` is the message, ``e.hint`` what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InvalidInputError(QswapError):
    """The caller gave data or options that cannot be used (bad file, bad field, bad value)."""


class NotFoundError(QswapError):
    """A named thing (encoder, bundled model, document, index) does not exist."""


class ConflictError(QswapError):
    """The request is valid but clashes with current state (already exists, in use)."""


class SpaceMismatchError(ConflictError):
    """Two embedding spaces differ: documents and queries from them are not comparable."""

    def __init__(self, message: str, field: str, expected: object, got: object, hint: str = "") -> None:
        super().__init__(message, hint)
        self.field = field
        self.expected = expected
        self.got = got


class IntegrityError(QswapError):
    """Stored data is corrupt or tampered with: checksum mismatch, truncated or missing file."""


class GuardRefusedError(ConflictError):
    """An encoder significantly degrades its sentinel sets and was not registered with force.

    ``guard`` is the evidence (the guard record with its per-sentinel table), when there is one.
    """

    def __init__(self, message: str, hint: str = "", guard: dict | None = None) -> None:
        super().__init__(message, hint)
        self.guard = guard


class GuardPendingError(ConflictError):
    """The encoder is still being evaluated on the server's sentinels: not servable yet."""


class InsufficientStorageError(QswapError):
    """The server's disk (or the user's quota) is full: a write could not be made, nothing was changed."""
