"""server/http/errors.py: the one table from error class to HTTP status and code."""

from __future__ import annotations

from pydantic import BaseModel

from qswap.errors import (ConflictError, DeadlineExceededError, GuardRefusedError, IndexCorruptError, IntegrityError,
                          InvalidInputError, LimitExceededError, NotFoundError, OverloadedError, SpaceMismatchError)
from qswap.server.http.errors import status_for


class _Body(BaseModel):
    q: str


def test_error_map_is_the_one_table():
    assert status_for(OverloadedError("m")) == (429, "overloaded")
    assert status_for(DeadlineExceededError("m")) == (504, "deadline_exceeded")
    assert status_for(IndexCorruptError("m")) == (500, "index_corrupt")   # a subclass overrides its parent


def test_error_map():
    assert status_for(SpaceMismatchError("m", "dim", 1, 2)) == (409, "space_mismatch")
    assert status_for(GuardRefusedError("m")) == (409, "guard_refused")
    assert status_for(ConflictError("m")) == (409, "conflict")
    assert status_for(NotFoundError("m")) == (404, "not_found")
    assert status_for(IntegrityError("m")) == (422, "integrity_error")
    assert status_for(LimitExceededError("m")) == (422, "limit_exceeded")
    assert status_for(InvalidInputError("m")) == (400, "invalid_input")


def test_a_body_that_stops_arriving_is_503_retry_not_400():
    """A body cut off mid-request (behind Ray Serve: a request re-sent to another replica after the
    first one died holding its body) is not the client's fault: 503 with Retry-After."""
    import asyncio
    import json

    from fastapi import FastAPI

    from qswap.server.http.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/x")
    async def x(body: _Body) -> dict:
        return {"q": body.q}

    async def call(messages: list[dict]) -> tuple[int, dict, dict]:
        sent: list[dict] = []
        queue = list(messages)

        async def receive() -> dict:
            return queue.pop(0) if queue else {"type": "http.disconnect"}

        async def send(m: dict) -> None:
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": "/x", "raw_path": b"/x", "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")],
                 "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
        await app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, json.loads(body)

    status, headers, body = asyncio.run(call([{"type": "http.disconnect"}]))
    assert status == 503 and body["error"] == "not_ready" and headers["retry-after"] == "1", body
    status, _, body = asyncio.run(call([{"type": "http.request", "body": b'{"q": "ok"}', "more_body": False}]))
    assert status == 200 and body == {"q": "ok"}
