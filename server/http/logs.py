"""Structured logs (JSON lines) and the per-request context: request id, body limit, metrics.

:class:`RequestContextMiddleware` is a plain ASGI middleware (no per-request task or body
buffering) that gives every request an id (the client's ``X-Request-ID`` if it is sane),
enforces the body-size limits, records latency metrics by route template, and writes one
access-log line.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import random
import re
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qswap.after_import import after_import
from qswap.errors import InternalServerError, PayloadTooLargeError, QswapError
from qswap.server.http.dialects import dialect_for, shape_error
from qswap.server.http.errors import error_body_of

REQUEST_ID_HEADER = "X-Request-ID"
_RID_NAME = REQUEST_ID_HEADER.lower().encode("latin-1")
_SANE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("qswap_request_id", default=None)
access_log = logging.getLogger("qswap.server.access")

_STANDARD = set(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {"message", "asctime", "taskName",
                                                                         "color_message"}  # uvicorn's ANSI copy


def _iso(created: float) -> str:
    """A record's time in ISO 8601, UTC, to the microsecond (what log stacks parse without a pattern)."""
    return datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        for k, v in vars(record).items():
            if k not in _STANDARD and k not in out:
                out[k] = v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(json_lines: bool = True, level: int = logging.INFO) -> None:
    """Send every log record (ours and uvicorn's) to stderr, as JSON lines or plain text."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    # uvicorn's loggers and the libraries that keep a stderr handler of their own (transformers)
    # go through this one handler; Python warnings too, so that stderr stays one JSON object a line.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "transformers", "py.warnings"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.captureWarnings(True)
    # transformers adds its own handler (and stops propagation) when it configures itself, which
    # its logging module does as soon as it is imported: undo that then, without importing it now
    # (a second of every start; a server serving from cached exports never imports it).
    after_import("transformers.utils.logging", _propagate_transformers)


def _propagate_transformers(hf_logging: Any) -> None:
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


# Fresh request ids: 128 random bits as 32 hex digits, as uuid4().hex has them, from a generator
# seeded from the OS once (again in a forked child), not a system call per request (uuid4).
# They name a request in logs and answers; nothing relies on them being unpredictable.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_request_id(given: str | None) -> str:
    """The client's id when it is short and plain, else a fresh one (32 hex digits)."""
    if given and _SANE_ID.match(given):
        return given
    return f"{_ids.getrandbits(128):032x}"


class _BodyTooLarge(HTTPException):
    """Raised from ``receive``; FastAPI re-raises HTTPExceptions met while reading the body (and
    would turn any other exception there into a 400); the handler answers PayloadTooLargeError."""

    def __init__(self, limit: int) -> None:
        super().__init__(PayloadTooLargeError.status, f"request body exceeds {limit} bytes")


class RequestContextMiddleware:
    """Request id, body-size limit, metrics and access log for every HTTP request."""

    def __init__(self, app: ASGIApp, *, limit_for: Callable[[Scope], int],
                 metrics: Callable[[], Any]) -> None:
        self.app = app
        self.limit_for = limit_for
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = declared = None
        for k, v in scope.get("headers", ()):   # the two headers read here, not a dict of all of them
            name = k.lower()
            if name == _RID_NAME:
                given = v.decode("latin-1")
            elif name == b"content-length":
                declared = v.decode("latin-1")
        rid = new_request_id(given)
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        start = time.perf_counter()
        status = 500
        limit = self.limit_for(scope)

        started = False

        async def send_wrapped(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(REQUEST_ID_HEADER.encode(), rid.encode())]
            await send(message)

        try:
            if declared is not None and declared.isdigit() and int(declared) > limit:
                # Refuse before reading a byte; the client learns the limit.
                await self._too_large(scope, send_wrapped, limit, rid)
                return
            received = 0

            async def receive_limited() -> Message:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise _BodyTooLarge(limit)
                return message

            await self.app(scope, receive_limited, send_wrapped)
        except Exception:
            # A bug, not bad input: log it with the request id and answer a JSON 500 (with the
            # X-Request-ID header) instead of letting the outer error middleware do it.
            logging.getLogger("qswap.server").exception("unhandled error", extra={"request_id": rid})
            if started:
                raise
            await self._send_error(send_wrapped, InternalServerError(
                "internal server error", "the server logs have the details (search for the request id)"), rid,
                scope["path"])
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            encoder = scope.get("state", {}).get("encoder", "")
            m = self.metrics()
            if m is not None:
                m.child(m.requests, template, scope["method"], str(status)).inc()
                m.child(m.request_seconds, template, encoder).observe(elapsed)
            if template not in ("/healthz", "/metrics", "/readyz"):
                access_log.info("request", extra={
                    "request_id": rid, "method": scope["method"], "path": scope["path"], "route": template,
                    "status": status, "duration_ms": round(elapsed * 1000, 3), "encoder": encoder or None})
            request_id_var.reset(token)

    async def _too_large(self, scope: Scope, send: Send, limit: int, rid: str) -> None:
        await self._send_error(send, PayloadTooLargeError(
            f"request body exceeds {limit} bytes",
            "send a smaller body (see the server's max_body_bytes / max_upload_bytes)"), rid, scope["path"], close=True)

    async def _send_error(self, send: Send, exc: QswapError, rid: str, path: str, close: bool = False) -> None:
        """Answer ``exc`` from here, outside the app's exception handlers (same body, same metric)."""
        status, body, _ = error_body_of(exc, request_id=rid)
        m = self.metrics()
        if m is not None:
            m.errors.labels(code=body["error"], status=str(status)).inc()
        await self._send_json(send, status, shape_error(dialect_for(path), status, body), close=close)

    @staticmethod
    async def _send_json(send: Send, status: int, body: dict[str, Any], close: bool = False) -> None:
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
