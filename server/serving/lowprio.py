"""Work for large requests at the lowest CPU priority: the bulk lane's passes and their tokenising.

A large request (a long query list, a long embedding input, an upsert's documents) costs
tokenising as well as forward passes: 64 texts of 512 tokens are 30-80 ms of tokenizer time.
Done in the batch worker's tokens stage, every one-query search queued behind it waits that
long; done on a default executor thread, it runs beside the interactive lane at its priority.
:class:`LowPriority` is one worker thread at :data:`BULK_NICE` on which large requests are
tokenised one after another, and the bulk lane's forward thread takes the same nice value
(:func:`lower_priority`).

The tokenizer must do that work on the thread that asks for it. ``tokenizers`` runs
``encode_batch`` on a thread pool of its own (Rust's rayon) whose threads are made once, by
the first thread that tokenises, and keep that thread's priority (normal: the server's loader):
a large request tokenised "on" a nice-19 thread ran on every core at normal priority, beside
the searches it was meant to yield to. :func:`tokenize_on_caller` turns that pool off for the
process (each tokenisation then runs on the calling thread, at its priority; a one-query
search is no slower: its encode_batch holds one text).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from qswap.errors import NotReadyError

T = TypeVar("T")

#: Nice value of the bulk lane's threads (the lowest priority): under contention the interactive
#: lane's threads get ~99 % of a shared core (CFS weights 1024 vs 15); alone, the bulk lane runs
#: at full speed. Measured with nice 10 (~90 %): normal-client p99 still ~2x under a long-query
#: attacker (bench adversarial, shared machine).
BULK_NICE = 19


#: The ``tokenizers`` setting read at every ``encode_batch`` (false: on the calling thread).
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


def tokenize_on_caller() -> None:
    """Make ``tokenizers`` tokenise on the calling thread, at its priority, from now on (the
    library reads the setting at every call; see the module docstring). Process-wide: a server
    chooses the priority of each thread that tokenises."""
    os.environ[TOKENIZERS_PARALLELISM] = "false"


def lower_priority() -> None:
    """Give the calling thread the nice value :data:`BULK_NICE` (Linux: per thread); elsewhere,
    or when not allowed, it keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BULK_NICE)
    except (AttributeError, OSError):
        pass


def idle_priority() -> None:
    """Run the calling thread under Linux's ``SCHED_IDLE`` policy: any thread of normal policy
    that wakes on its core takes the core at once (a nice-19 thread may first run out its time
    slice, while a one-query search's ONNX Runtime threads wait for each other at every node).
    Alone, it runs at full speed. Elsewhere, or when not allowed, :func:`lower_priority`."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        lower_priority()


class LowPriority:
    """One worker thread at :data:`BULK_NICE` (see the module docstring)."""

    def __init__(self, name: str = "qswap-bulk-tokens") -> None:
        tokenize_on_caller()   # else the tokenizer's own pool does this thread's work at normal priority
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=lower_priority)

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Run ``fn(*args)`` on the worker (any thread may ask)."""
        return self._pool.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the worker and wait for it (event loop side).

        Raises:
            NotReadyError: the worker has ended (the server is stopping).
        """
        try:
            fut = self._pool.submit(fn, *args)
        except RuntimeError:   # shut down
            raise NotReadyError("the server is shutting down", "retry against another instance") from None
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        """Finish what was submitted and end the worker."""
        self._pool.shutdown(wait=True)
