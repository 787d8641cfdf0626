"""The one error table: what the server answers for each named error, the client reads back as
the same error, fields included."""

from __future__ import annotations

import json

import pytest

from qswap.errors import (ERRORS, GuardRefusedError, MethodNotAllowedError, NotFoundError, OverloadedError,
                          QswapError, SpaceMismatchError, error_class, error_from_body)
from qswap.server.http.dialects import shape_error
from qswap.server.http.errors import error_body_of


def _make(cls: type[QswapError]) -> QswapError:
    if cls is SpaceMismatchError:
        return cls("spaces differ", field="dim", expected=32, got=64, hint="tune on the served base")
    if cls is GuardRefusedError:
        return cls("degrades", "re-tune", guard={"verdict": "refused"})
    if cls is OverloadedError:
        return cls("busy", "retry", retry_after=3)
    return cls("what is wrong", "what to do")


@pytest.mark.parametrize("dialect", ["qswap", "openai", "tei"])
@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_server_body_reads_back_as_the_same_error(cls, dialect):
    sent = _make(cls)
    status, body, headers = error_body_of(sent)
    assert (status, body["error"]) == (cls.status, cls.code)
    if headers and "Retry-After" in headers:
        body["retry_after"] = int(headers["Retry-After"])   # the client reads the header into the body
    body = shape_error(dialect, status, body)
    if dialect == "openai":
        assert body["error"]["code"] == cls.code and sent.message in body["error"]["message"]
    got = error_from_body(status, json.loads(json.dumps(body)))
    assert type(got) is cls and (got.message, got.hint) == (sent.message, sent.hint)
    for field in ("field", "expected", "got", "guard", "retry_after"):
        if hasattr(sent, field):
            assert getattr(got, field) == getattr(sent, field)


def test_codes_are_unique_and_statuses_fall_back():
    assert len({c.code for c in ERRORS}) == len(ERRORS)
    assert error_class(None, 405) is MethodNotAllowedError          # a framework's bare status
    assert error_class("from_a_newer_server", 404) is NotFoundError
    assert error_class(None, 418) is QswapError
    assert type(error_from_body(502, "<html>bad gateway</html>")) is QswapError
