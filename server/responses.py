"""Shared route helpers: the error responses documented in OpenAPI, and the app state accessor."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from qswap.server.models import ErrorBody
from qswap.server.state import ServerState

_ERR = {"model": ErrorBody}
# Error statuses a route can answer (bodies are always ErrorBody).
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERR, "description": "invalid input"},
    401: {**_ERR, "description": "missing or wrong bearer token"},
    404: {**_ERR, "description": "unknown encoder, alias or document"},
    409: {**_ERR, "description": "conflict: space mismatch (names the field), guard refusal, in use"},
    413: {**_ERR, "description": "request body too large"},
    422: {**_ERR, "description": "validation error, limit exceeded, or corrupt encoder (integrity)"},
    503: {**_ERR, "description": "not ready yet (loading) or overloaded"},
}
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {**ERRORS, 403: {**_ERR, "description": "admin routes disabled"}}


def state_of(request: Request) -> ServerState:
    return request.app.state.qs
