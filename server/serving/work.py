"""What the batch worker's queues carry: a request's rows (:class:`Job`), the rows of one job in
one micro-batch (:class:`Slice`) and a function run between batches (:class:`Call`).

A job is made once, when its request is admitted (:mod:`qswap.server.serving.batching`), and
travels through every stage of the pipeline: its texts are tokenised once (by the cost gate or
the tokens stage; the encodings stay on the job), its rows are encoded slice by slice
(:mod:`qswap.server.serving.forward`), and the answer stage
(:mod:`qswap.server.serving.answers`) finishes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

#: Put on the intake queue by ``stop``: it passes through every stage in order, behind what is queued.
STOP = object()


@dataclass(eq=False)   # identity: jobs live in a set
class Job:
    """One admitted request's rows (queries, or texts for the document tower) and its progress."""

    texts: list[str]
    key: str
    k: int
    filter: dict[str, Any] | None
    with_text: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float
    deadline: float = float("inf")
    on_done: Callable[[], None] | None = None
    finished: bool = False
    tokens: list[int] | None = None      # per row, counted on the worker when first taken
    encodings: list[Any] | None = None   # per row, the tokenizer's (queries): tokenised once, encoded as is
    next_row: int = 0                    # rows before it are encoded (a split request)
    parts: list[np.ndarray] = field(default_factory=list)
    trunc: list[bool] = field(default_factory=list)
    started: float | None = None
    encode_s: float = 0.0
    failed: bool = False                 # its error is posted; nothing more runs for it
    vectors_only: bool = False           # an embedding request: encoded in the batch, not searched
    documents: bool = False              # rows for the document tower: never in a batch with queries
    answering: bool = False              # handed to the answer stage, which finishes it


@dataclass
class Slice:
    """Rows ``lo:hi`` of one job in one micro-batch."""

    job: Job
    lo: int
    hi: int


@dataclass(eq=False)
class Call:
    """``fn(*args, **kwargs)`` run on the writes thread (an index write; :mod:`qswap.server.serving.writes`)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    kwargs: dict[str, Any] = field(default_factory=dict)
    deadline: float = float("inf")
    key: str = ""
    finished: bool = False
