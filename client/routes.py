"""The client's methods, one per route, written once for the sync and the async client.

Each method is a :class:`Route` over a builder of :mod:`qswap.client.calls`: it takes the
builder's arguments, builds the :class:`~qswap.client.calls.Call` and hands it to the client's
``_send``. Type checkers and IDEs see the builder's parameters and, from the client's kind, the
answer itself (:class:`~qswap.client.Client`) or an awaitable of it
(:class:`~qswap.client.AsyncClient`): ``client.search(...)`` is a ``SearchResponse`` there,
``await client.search(...)`` here.
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable, Generic, ParamSpec, TypeVar, overload

from qswap.client import calls

P = ParamSpec("P")
T = TypeVar("T")


class SyncSender:
    """Base of the synchronous client: ``_send`` answers the call's value."""

    def _send(self, call: calls.Call[T]) -> T:
        raise NotImplementedError


class AsyncSender:
    """Base of the asynchronous client: ``_send`` answers an awaitable of the call's value."""

    async def _send(self, call: calls.Call[T]) -> T:
        raise NotImplementedError


class Route(Generic[P, T]):
    """A client method that sends what ``build`` makes (same parameters, same docstring)."""

    def __init__(self, build: Callable[P, calls.Call[T]]) -> None:
        self.build = build
        functools.update_wrapper(self, build)

    @overload
    def __get__(self, obj: None, owner: type) -> "Route[P, T]": ...

    @overload
    def __get__(self, obj: SyncSender, owner: type) -> Callable[P, T]: ...

    @overload
    def __get__(self, obj: AsyncSender, owner: type) -> Callable[P, Awaitable[T]]: ...

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        build, send = self.build, obj._send

        @functools.wraps(build)
        def method(*args: Any, **kwargs: Any) -> Any:
            return send(build(*args, **kwargs))
        return method


class Routes:
    """Every route of the qswap API as a method; each takes the arguments of, and is documented
    by, the builder of the same name in :mod:`qswap.client.calls`."""

    search = Route(calls.search)
    embeddings = Route(calls.embeddings)
    models = Route(calls.models)
    model = Route(calls.model)
    tei_embed = Route(calls.tei_embed)
    tei_info = Route(calls.tei_info)
    tei_tokenize = Route(calls.tei_tokenize)
    tei_decode = Route(calls.tei_decode)
    tei_health = Route(calls.tei_health)
    healthz = Route(calls.healthz)
    ready = Route(calls.ready)
    metrics = Route(calls.metrics)
    info = Route(calls.info)
    encoders = Route(calls.encoders)
    encoder = Route(calls.encoder)
    register_path = Route(calls.register_path)
    upload_encoder = Route(calls.upload_encoder)
    delete_encoder = Route(calls.delete_encoder)
    aliases = Route(calls.aliases)
    set_alias = Route(calls.set_alias)
    delete_alias = Route(calls.delete_alias)
    document_job = Route(calls.document_job)
    delete_documents = Route(calls.delete_documents)
    experiments = Route(calls.experiments)
    experiment = Route(calls.experiment)
    start_experiment = Route(calls.start_experiment)
    stop_experiment = Route(calls.stop_experiment)
    promote_experiment = Route(calls.promote_experiment)
    rollback_experiment = Route(calls.rollback_experiment)
    feedback = Route(calls.feedback)
