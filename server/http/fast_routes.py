"""The hot model routes served without FastAPI's per-request machinery.

``POST /v1/search`` and ``POST /v1/embeddings`` are most of the traffic, and on a small model
FastAPI's own work per request (solving the dependencies, ``json.loads`` then validating the
dict, two ``AsyncExitStack``\\ s) is a large share of the event loop's time. A :class:`FastRoute`
sits ahead of such a route's FastAPI route and serves a well-formed request itself: it
validates the raw body with a cached pydantic ``TypeAdapter`` and runs the same gate
(:func:`~qswap.server.serving.gate.search_admission`'s auth rule, readiness, deadline, closing the
admission) and the same route function. Anything it does not take as is (a body that does not
validate, another content type, an unusual ``X-Request-Timeout``) it hands to the FastAPI route
with the body replayed, so every refusal of a malformed request is FastAPI's own answer.
The FastAPI route stays registered: it documents the route in the OpenAPI schema
(``get_openapi`` reads only FastAPI routes) and answers what the fast route passes on.
"""

from __future__ import annotations

import re
from typing import Any, Awaitable, Callable, Generic, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette._exception_handler import wrap_app_handling_exceptions
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, NoMatchFound, get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qswap.server.http.auth import bearer, require_search
from qswap.server.http.responses import MAX_REQUEST_TIMEOUT_S
from qswap.server.serving.gate import Admission, admit

M = TypeVar("M", bound=BaseModel)

#: What the route function does with a validated body and the request's admission.
Handler = Callable[[Any, Request, Admission], Awaitable[Response]]

# A header value pydantic reads as the same float (no sign, exponent, blanks or underscores):
# anything else goes to FastAPI, whose validation decides.
_PLAIN_NUMBER = re.compile(rb"[0-9]{1,9}(\.[0-9]{1,9})?")
_TIMEOUT, _CONTENT_TYPE = b"x-request-timeout", b"content-type"
_JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")
_DECLINED = "qswap.fast_route_declined"   # set in the scope: the app's router matches past this route


class FastRoute(BaseRoute, Generic[M]):
    """``POST path`` answered directly when the request is well formed, else by ``route``."""

    def __init__(self, route: APIRoute, model: type[M], handler: Handler, router: ASGIApp) -> None:
        self.route = route
        self.router = router
        self.path = route.path
        self.adapter: TypeAdapter[M] = TypeAdapter(model)
        self.handler = handler

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (scope["type"] == "http" and scope["method"] == "POST" and get_route_path(scope) == self.path
                and _DECLINED not in scope):
            # "route" as FastAPI sets it: the metrics and the access log name the route's template.
            return Match.FULL, {"route": self.route, "endpoint": self.route.endpoint, "path_params": {}}
        return Match.NONE, {}   # other methods reach the FastAPI route (405 stays FastAPI's)

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)   # url_for names the FastAPI route

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        declined: list[bytes] = []

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            try:
                body = await request.body()
            except HTTPException:   # the body limit (RequestContextMiddleware): as FastAPI, raised again
                raise
            except Exception as e:   # e.g. the client went away mid-body: FastAPI's 400, which the handler names
                raise HTTPException(400, "There was an error parsing the body") from e
            parsed = self._parse(scope, body)
            if parsed is None:
                declined.append(body)
                return
            model, timeout = parsed
            # search_admission's steps, in its order: auth, then readiness and the deadline.
            await require_search(request, await bearer(request))
            adm = admit(request, timeout)
            try:
                response = await self.handler(model, request, adm)
            finally:
                await adm.close()
            await response(scope, receive, send)

        # The app's exception handlers answer what the gate or the handler raises, as for FastAPI.
        await wrap_app_handling_exceptions(app, request)(scope, receive, send)
        if declined:
            # Routed again past this route: FastAPI's route answers with everything FastAPI
            # wraps it in, exactly as without this route.
            scope[_DECLINED] = True
            await self.router(scope, _replay(declined[0], receive), send)

    def _parse(self, scope: Scope, body: bytes) -> tuple[M, float | None] | None:
        """The validated body and the ``X-Request-Timeout`` seconds; None to let FastAPI answer."""
        timeout: float | None = None
        content_type = None
        for k, v in scope["headers"]:
            if k == _TIMEOUT and timeout is None:
                if not _PLAIN_NUMBER.fullmatch(v):
                    return None
                timeout = float(v)
                if not 0 < timeout <= MAX_REQUEST_TIMEOUT_S:   # TIMEOUT_HEADER's bounds
                    return None
            elif k == _CONTENT_TYPE and content_type is None:
                content_type = v.lower()
        if content_type not in _JSON_TYPES:   # FastAPI reads no JSON without its content type
            return None
        try:
            return self.adapter.validate_json(body), timeout
        except ValidationError:
            return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first (for the FastAPI route)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def install_fast_route(app: FastAPI, router: APIRouter, path: str, model: type[BaseModel], handler: Handler) -> None:
    """Put a :class:`FastRoute` for ``POST path`` ahead of the app's FastAPI route for it.

    Args:
        app: the app, with ``router`` included (without a prefix).
        router: the router that holds the FastAPI route.
        path: the route's path.
        model: the body's pydantic model (the FastAPI route's body parameter).
        handler: the route function, given the validated body, the request and its admission.
    """
    route = next(r for r in router.routes if isinstance(r, APIRoute) and r.path == path and "POST" in r.methods)
    app.router.routes.insert(0, FastRoute(route, model, handler, app.router))
