"""The FastAPI app factory.

``create_app(settings)`` builds the app without loading anything; its lifespan starts loading
(base model, index, registry, default encoder) in a background thread and, on shutdown, stops
the batch worker and closes the index. One app = one :class:`ServerState`, with its own
Prometheus registry, so several apps can live in one process (tests do that).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI
from starlette.types import Scope

from qswap import __version__
from qswap.atomic import atomic_write_bytes
from qswap.server.http.routes import documents, embeddings, encoders, feedback, health, search, tei
from qswap.server.config import ServerSettings
from qswap.server.http.errors import install_error_handlers
from qswap.server.http.fast_routes import install_fast_route
from qswap.server.http.compat_models import EmbeddingRequest
from qswap.server.http.logs import RequestContextMiddleware
from qswap.server.http.models import METADATA_VALUE_SCHEMA, SearchRequest
from qswap.server.http.synfilter import watch_listeners
from qswap.server.state import ServerState

OPENAPI_FILE = Path(__file__).parents[1] / "openapi.json"   # the committed copy: server/openapi.json

DESCRIPTION = """\
Retrieval over one frozen document index, with the **query encoder chosen per request**.

- `POST /v1/search` searches with the default encoder, a named one (`name` or `name@version`),
  or the one a `domain` alias points to. Each result says which encoder version served it.
- Encoders are registered live (`POST /v1/encoders`), aliases switch atomically, and
  concurrent requests are micro-batched into one forward pass and one index search.
- Admin routes need the admin bearer token. Errors are `{"error", "detail", "hint"}`.
"""


def _limit_for(settings: ServerSettings):
    def limit(scope: Scope) -> int:
        if scope.get("method") == "POST" and scope.get("path") == "/v1/encoders":
            for k, v in scope.get("headers", ()):
                if k == b"content-type" and v.lower().startswith(b"multipart/"):
                    return settings.max_upload_bytes
        return settings.max_body_bytes
    return limit


def create_app(settings: ServerSettings | None = None, *, check: bool = True,
               state: ServerState | None = None) -> FastAPI:
    """Build the FastAPI app of the search server.

    Args:
        settings: what to serve and how (default: ``ServerSettings()``, read from ``QSWAP_*``).
        check: run the settings' safety checks; ``False`` for schema generation, and for
            ``qswap serve``, which checks before it imports the model stack.
        state: replaces the default ``ServerState`` (a Ray Serve replica passes its own, which
            shares the registry and the index with the other replicas).

    Returns:
        The app; its lifespan loads the model, the index and the registry.
    """
    settings = settings if settings is not None else (state.settings if state is not None else ServerSettings())
    if check:
        settings.check()
    state = state if state is not None else ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = FastAPI(title="qswap", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.qs = state
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, limit_for=_limit_for(settings), metrics=lambda: state.metrics)
    for module in (search, embeddings, tei, encoders, documents, feedback, health):
        app.include_router(module.router)
    # The two hot routes skip FastAPI's per-request work (qswap.server.http.fast_routes).
    install_fast_route(app, search.router, "/v1/search", SearchRequest, search.search)
    install_fast_route(app, embeddings.router, "/v1/embeddings", EmbeddingRequest, embeddings.answer)
    plain_openapi = app.openapi

    with_dim = False   # the model's dimension is known once it is loaded: write it then

    def openapi() -> dict[str, Any]:
        nonlocal with_dim
        dim = state.base.dim if state.base is not None else None
        if app.openapi_schema is None or (dim is not None and not with_dim):
            app.openapi_schema = None
            _write_limits(plain_openapi(), settings, dim)
            with_dim = dim is not None
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _write_limits(schema: dict[str, Any], settings: ServerSettings, dim: int | None = None) -> None:
    """Put the configured limits (and, once loaded, the model's dimension) into the schema, so
    that it says what this server refuses."""
    models = schema.get("components", {}).get("schemas", {})
    models["MetadataValue"] = METADATA_VALUE_SCHEMA   # recursive: referenced, not inlined
    limits: list[tuple[str, str, str, int]] = [
        ("SearchRequest", "k", "maximum", settings.max_k),
        ("SearchRequest", "offset", "maximum", settings.max_k),
        ("SearchRequest", "queries", "maxItems", settings.max_queries),
        ("UpsertDocuments", "documents", "maxItems", settings.max_documents),
        ("DeleteDocuments", "ids", "maxItems", settings.max_documents)]
    if dim is not None:
        limits += [("EmbeddingRequest", "dimensions", "maximum", dim), ("TeiEmbedRequest", "dimensions", "maximum", dim)]
    for model, field, key, value in limits:
        prop = models.get(model, {}).get("properties", {}).get(field)
        if prop is not None:
            prop[key] = value
    for model, field in (("EmbeddingRequest", "input"), ("TeiEmbedRequest", "inputs")):
        for alt in models.get(model, {}).get("properties", {}).get(field, {}).get("anyOf", []):
            if alt.get("type") == "array":
                alt["maxItems"] = settings.max_embedding_inputs


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM/SIGINT, first makes the app stop admitting requests (503 with
    ``Connection: close`` from then on) and cancels guard evaluations; then stops accepting
    connections and waits for the requests in flight, at most ``timeout_graceful_shutdown``
    seconds less a short grace. Requests still running then are answered 503 JSON (not
    cancelled into a bare 500), and uvicorn gets that grace to write those answers."""

    ANSWER_GRACE_S = 1.0

    def _state(self) -> Any:
        return getattr(getattr(self.config.app, "state", None), "qs", None)

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self._state()
        if state is not None:
            state.begin_drain()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        watch_listeners(self)   # the kernel drops connection attempts over an address's share

    async def shutdown(self, sockets: Any = None) -> None:
        state = self._state()
        if state is not None and state.batcher is not None:
            for server in self.servers:
                server.close()   # no new connections while the admitted requests finish
            loop = asyncio.get_running_loop()
            # The answer grace comes out of the bound, so the process exits within shutdown_timeout
            # (plus closing: the worker ends its slice, the stores close).
            end = loop.time() + max(self.config.timeout_graceful_shutdown - self.ANSWER_GRACE_S, 0.0)
            while state.batcher.pending and loop.time() < end:
                await asyncio.sleep(0.05)
            state.abort_in_flight()
            self.config.timeout_graceful_shutdown = self.ANSWER_GRACE_S
        await super().shutdown(sockets)


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI schema (independent of settings), as JSON types."""
    app = create_app(ServerSettings.model_construct(), check=False)
    return json.loads(json.dumps(app.openapi()))


def openapi_text() -> str:
    return json.dumps(openapi_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_openapi(path: Path = OPENAPI_FILE) -> Path:
    """Write the OpenAPI schema atomically.

    Args:
        path: where to write it (default: the committed copy, ``server/openapi.json``).

    Returns:
        The path written.
    """
    atomic_write_bytes(Path(path), openapi_text().encode())
    return Path(path)
