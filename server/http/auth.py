"""Bearer-token checks for admin and (optionally) search routes.

Admin routes (encoders, aliases, document changes) are guarded by ``admin_token``; without one
they are switched off, unless the server runs ``--insecure`` (then they are open, but only to
loopback clients, and the server refuses to listen on anything but loopback). Search is open
unless ``search_token`` is set; the admin token is accepted wherever the search token is.
``/metrics`` (encoder keys, sentinel names, their nDCG and p-values) needs ``metrics_token``
when one is set (a scraper's own credential), else it follows the search rule.
"""

from __future__ import annotations

import hmac

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from qswap.server.config import ServerSettings, is_loopback
from qswap.errors import ForbiddenError, UnauthorizedError

bearer = HTTPBearer(auto_error=False, description="admin token (admin routes) or search token (search)")


def _settings(request: Request) -> ServerSettings:
    return request.app.state.qs.settings


def token_matches(given: str, secret: SecretStr | None) -> bool:
    """Constant-time comparison of a presented token with a configured one."""
    if secret is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), secret.get_secret_value().encode("utf-8"))


def _given(creds: HTTPAuthorizationCredentials | None) -> str | None:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        return None
    return creds.credentials


# The dependencies are ``async`` on purpose: FastAPI runs a plain ``def`` dependency in its
# thread pool, a thread hop on every request that costs more than the check itself.
async def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Dependency of every admin route."""
    s = _settings(request)
    mode = s.admin_mode
    if mode == "token":
        given = _given(creds)
        if given is None:
            raise UnauthorizedError("this route needs the admin bearer token",
                                    "send 'Authorization: Bearer <admin token>'")
        if not token_matches(given, s.admin_token):
            raise UnauthorizedError("the bearer token is not the admin token", "check the token")
        return
    if mode == "insecure":
        client = request.client.host if request.client else ""
        if not is_loopback(client):
            raise ForbiddenError("admin routes of an --insecure server answer loopback clients only",
                                 "call from the server machine, or restart the server with an admin token")
        return
    raise ForbiddenError("admin routes are disabled: the server has no admin token",
                         "restart with --token / QSWAP_ADMIN_TOKEN (or --insecure for local use)")


def _require_one_of(creds: HTTPAuthorizationCredentials | None, what: str, name: str,
                    *secrets: SecretStr | None) -> None:
    given = _given(creds)
    if given is None:
        raise UnauthorizedError(f"{what} needs a bearer token", f"send 'Authorization: Bearer <{name}>'")
    if not any(token_matches(given, t) for t in secrets):
        raise UnauthorizedError(f"the bearer token is not valid for {what}", "check the token")


async def require_search(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Dependency of search and read-only routes: open unless a search token is configured."""
    s = _settings(request)
    if s.search_token is not None:
        _require_one_of(creds, "search", "search token", s.search_token, s.admin_token)


async def require_metrics(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Dependency of ``/metrics``: the metrics token (or the admin token) when one is set, else
    the search rule (open unless a search token is set)."""
    s = _settings(request)
    if s.metrics_token is not None:
        _require_one_of(creds, "/metrics", "metrics token", s.metrics_token, s.admin_token)
    elif s.search_token is not None:
        _require_one_of(creds, "/metrics", "search token", s.search_token, s.admin_token)
