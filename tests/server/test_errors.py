"""server/http/errors.py: the one table from error class to HTTP status and code."""

from __future__ import annotations

from qswap.errors import (ConflictError, DeadlineExceededError, GuardRefusedError, IndexCorruptError, IntegrityError,
                          InvalidInputError, LimitExceededError, NotFoundError, OverloadedError, SpaceMismatchError)
from qswap.server.http.errors import status_for


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
