"""Impression ids: the server's key for a captured search, signed for whoever searched.

A captured search answers with an ``impression`` id; feedback names it. The id is
``<nonce>.<tag>``: 12 random bytes (the capture key, so ids cannot be guessed) and an HMAC-SHA256
tag over the nonce and the **client** that searched, under a server secret (so ids cannot be
forged, and one client's id is worthless to another: feedback must come with the same
credentials as the search). A forged, foreign or mistyped id is refused on the event loop
before any store work.

The client, as the server knows it (:func:`client_of`):

- a request with a configured bearer token (search or admin) is an application the operator
  trusts: ``token:<which>``, plus the ``session`` the application names for its end user, if any;
- any other request is its network address: ``addr:<host>`` (a session it names is ignored:
  anyone can make one up).

The secret is ``--feedback-secret`` (``QSWAP_FEEDBACK_SECRET``) or, without one, a random key
created once in the feedback directory (``impression.key``, mode 0600), so that restarts and
Ray replicas sharing the directory accept each other's ids. See docs/security.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from fastapi import Request
from pydantic import SecretStr

from qswap.server.config import ServerSettings
from qswap.server.http.auth import token_matches

KEY_FILE = "impression.key"
_NONCE_BYTES = 12
_TAG_BYTES = 16


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
    except (ValueError, TypeError):
        return None


class ImpressionSigner:
    """Issues and checks impression ids under one secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the impression secret must hold at least 16 bytes")
        self._secret = secret

    @classmethod
    def for_directory(cls, directory: Path, given: SecretStr | None = None) -> "ImpressionSigner":
        """The signer of a feedback directory: ``given``, else its key file (created once,
        exclusively, so concurrent starts agree on one key)."""
        if given is not None:
            return cls(hashlib.sha256(given.get_secret_value().encode()).digest())
        path = Path(directory) / KEY_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            key = path.read_bytes()
            if len(key) < 32:   # another process is writing it: it writes 32 bytes in one call
                raise ValueError(f"{path.name} in the feedback directory is shorter than 32 bytes: remove it")
            return cls(key)
        key = secrets.token_bytes(32)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        return cls(key)

    def _tag(self, nonce: bytes, client: str) -> bytes:
        return hmac.new(self._secret, b"qswap-impression-1\0" + nonce + b"\0" + client.encode(),
                        hashlib.sha256).digest()[:_TAG_BYTES]

    def issue(self, client: str) -> tuple[str, str]:
        """A new impression id for ``client``; returns (the id, its capture key)."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        key = _b64(nonce)
        return f"{key}.{_b64(self._tag(nonce, client))}", key

    def verify(self, impression: str, client: str) -> str | None:
        """The capture key of ``impression`` when it was issued to ``client`` by this server's
        secret, else None (forged, foreign, mistyped)."""
        key, _, tag = impression.partition(".")
        nonce, given = _unb64(key), _unb64(tag)
        if nonce is None or given is None or len(nonce) != _NONCE_BYTES:
            return None
        return key if hmac.compare_digest(given, self._tag(nonce, client)) else None


def client_of(request: Request, settings: ServerSettings) -> str:
    """Who is searching or giving feedback, as the server can tell (see the module docstring):
    what an impression id is bound to."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token:
        for which, secret in (("search", settings.search_token), ("admin", settings.admin_token)):
            if token_matches(token, secret):
                return f"token:{which}"
    host = request.client.host if request.client else ""
    return f"addr:{host}"


def contributor(client: str, session: str | None) -> str:
    """Whose evidence a feedback is (the per-client bound of auto-promotion counts these): an
    application's end-user session when a trusted application names one, else the client."""
    return f"{client}/{session}" if session and client.startswith("token:") else client


__all__ = ["ImpressionSigner", "KEY_FILE", "client_of", "contributor"]
