"""The cost gate: the one admission path of every route that runs the model.

A route that encodes anything (search, ``/v1/embeddings`` for queries and for
``qswap/documents``, TEI embed, document upserts) takes an :class:`Admission` with the
:func:`search_admission` dependency (search auth, readiness, deadline: one dependency, as each
level costs the event loop per request) or, behind its own admin auth, :func:`admission`, and
passes it to the batch worker with each job. It gives the request, in one place:

1. a token bound (:meth:`Admission.bound_tokens`): at most ``max_request_tokens`` tokens per
   request, each text counted up to the model's max length, else 422 ``limit_exceeded``;
2. a deadline (``X-Request-Timeout`` or ``request_timeout_s``), read by the worker between
   slices: 504 ``deadline_exceeded``;
3. cancellation when the client disconnects: a watcher on the connection fails the request's
   jobs, and the worker drops the rest of them at its next slice; a client that abandons a
   request larger than one slice has its next such request refused for a while
   (:mod:`qswap.server.traffic.abandoned`, ``abandon_wait_s``);
4. the worker's own admission bound (429 ``overloaded``) and token slices interleaved fairly
   with other requests (:mod:`qswap.server.serving.batching`).

Background work (an upsert job, a shadow run) has no client to lose: it passes a plain
:class:`~qswap.server.serving.admission.Ticket`. ``tests/server/test_gate.py`` walks every route
so that a new one cannot reach the model without the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials
from starlette.types import Receive

from qswap.encoders.embedding import token_lengths
from qswap.errors import LimitExceededError
from qswap.server.http.auth import bearer, require_search
from qswap.server.http.responses import TIMEOUT_HEADER, ready_state_of, timeout_of
from qswap.server.serving.admission import Ticket
from qswap.server.state import ServerState
from qswap.server.traffic.impressions import client_of

# A token covers at most one word and at least half a character (a SentencePiece word marker
# plus one character); prefix and special tokens come on top. Between these bounds the
# tokenizer decides; outside them it need not run.
_TOKENS_PER_CHAR, _EXTRA_TOKENS = 2, 16


def _tokens_at_least(texts: list[str], most: int) -> int:
    """The fewest tokens ``texts`` can hold: their words, [CLS] and [SEP], each text at most ``most``."""
    return sum(min(len(t.split()) + 2, most) for t in texts)


class Admission(Ticket):
    """One HTTP request's pass through the cost gate (see the module docstring)."""

    def __init__(self, state: ServerState, timeout_s: float, receive: Receive | None = None,
                 client: Callable[[], str] | None = None) -> None:
        super().__init__(timeout_s)
        self.state = state
        self._receive = receive
        self._client = client   # who sent it (asked only of a large request)
        self._watcher: asyncio.Task | None = None
        self.admitted = time.monotonic()
        self.large = False      # more than one slice (or document rows), as far as the gate counted

    def watch(self, fut: asyncio.Future) -> None:
        """Fail ``fut`` when the client disconnects (the watcher starts with the first job)."""
        super().watch(fut)
        if self._receive is not None and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        # The body is read: the next message of the connection is its end (or the answer's).
        assert self._receive is not None
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if self.abandon():
            self.state.metrics.rejected.labels(reason="client_gone").inc()
            debtor = self._debtor() if self.large else None
            if debtor is not None:
                held = time.monotonic() - self.admitted
                self.state.abandoned.charge(debtor, max(held, self.state.settings.abandon_wait_s))

    def _debtor(self) -> str | None:
        """Who owes for this request when it is abandoned: an anonymous client (its address; a
        bearer token's application is trusted, as with ``feedback_rate``), or None (off)."""
        if self.state.settings.abandon_wait_s <= 0 or self._client is None:
            return None
        client = self._client()
        return None if client.startswith("token:") else client

    def _hold_back(self, large: bool) -> None:
        """Note a large request; refuse it (429) while its client owes for an abandoned one."""
        if not large:
            return
        self.large = True
        debtor = self._debtor()
        if debtor is not None:
            owed = self.state.abandoned.owed(debtor)
            if owed > 0:
                self.state.metrics.rejected.labels(reason="abandoned_before").inc()
                raise self.state.abandoned.refuse(owed)

    async def close(self) -> None:
        """Stop watching the connection (the answer is written, or the request failed)."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watcher

    async def bound_tokens(self, texts: list[str], *, documents: bool = False,
                           exact: bool = False) -> list[Any] | None:
        """Refuse a request over ``max_request_tokens``; its tokenizer encodings when they were
        needed (pass them on with the job: the request is then not tokenised again).

        Args:
            texts: the request's texts (each counted up to the model's max length).
            documents: count with the document prefix (texts for the document tower).
            exact: always tokenise (the caller needs the encodings); else a request certainly
                within the bound is not tokenised here (the worker tokenises it once).

        Returns:
            One encoding per text, or None when the request is certainly within the bound.

        Raises:
            LimitExceededError: (422) the texts hold more tokens than the bound.
            OverloadedError: (429) a request larger than one slice from a client that abandoned
                one (:mod:`qswap.server.traffic.abandoned`).
        """
        state = self.state
        limit = state.settings.max_request_tokens
        one_slice = state.settings.slice_tokens
        most = state.max_text_tokens
        self._hold_back(documents)   # document rows always run on the bulk lane
        at_most = sum(min(_TOKENS_PER_CHAR * len(t) + _EXTRA_TOKENS, most) for t in texts)
        if not exact and at_most <= limit:
            if at_most > one_slice:
                self._hold_back(_tokens_at_least(texts, most) > one_slice)
            return None
        at_least = _tokens_at_least(texts, most)
        encodings = tokens = None
        if at_least <= limit:
            self._hold_back(at_least > one_slice)   # before the tokenizer runs for it
            encodings = await state.batcher.low_priority(state.tokenize, texts, documents)   # a large request
            tokens = token_lengths(encodings)
            self._hold_back(sum(tokens) > one_slice)
        if tokens is None or sum(tokens) > limit:
            n = f"at least {at_least}" if tokens is None else str(sum(tokens))
            raise LimitExceededError(f"the inputs hold {n} tokens; the limit per request is {limit}",
                                     "send fewer or shorter inputs per request (split them over several; "
                                     "LangChain: chunk_size), or raise max_request_tokens")
        return encodings


def admit(request: Request, x_request_timeout: float | None) -> Admission:
    """The request's :class:`Admission` (the gate called directly, as the fast routes do).

    Raises:
        NotReadyError: (503) the server is not ready.
    """
    # The readiness check and the deadline are read here, not as dependencies of their own, so
    # that a model route's whole gate is one place. FastAPI solves each dependency per request on
    # the event loop (8.5 % of its GIL-held time under load); folding the levels into one did not
    # measurably reduce that (9.6 % after: bench/results/peer/profile.md).
    state = ready_state_of(request)
    return Admission(state, timeout_of(request, x_request_timeout), request.receive,
                     lambda: client_of(request, state.settings))


async def admission(request: Request, x_request_timeout: float = TIMEOUT_HEADER) -> AsyncIterator[Admission]:
    """The request's :class:`Admission` (a FastAPI dependency of every route that runs the model;
    its route's own auth dependency runs first: the admin routes').

    Args:
        request: the request (its connection is watched for a disconnect).
        x_request_timeout: its deadline from now (the header; default ``request_timeout_s``).

    Yields:
        The admission of the ready server, closed when the request is done.

    Raises:
        NotReadyError: (503) the server is not ready (:func:`~qswap.server.http.responses.ready_state`).
    """
    adm = admit(request, x_request_timeout)
    try:
        yield adm
    finally:
        await adm.close()


async def search_admission(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer),
                           x_request_timeout: float = TIMEOUT_HEADER) -> AsyncIterator[Admission]:
    """:func:`admission` after the search auth rule (:func:`~qswap.server.http.auth.require_search`),
    in one dependency: the search and embedding routes' whole gate.

    Args:
        request: the request.
        creds: its bearer token, if any.
        x_request_timeout: its deadline from now (the header).

    Yields:
        The admission, closed when the request is done.

    Raises:
        UnauthorizedError: (401) a search token is set and the request does not carry it.
        NotReadyError: (503) the server is not ready.
    """
    await require_search(request, creds)
    adm = admit(request, x_request_timeout)
    try:
        yield adm
    finally:
        await adm.close()
