"""Index writes on a thread of their own, one at a time in arrival order.

An index commit (an upsert job's documents, a delete) is disk and SQLite work, 40-120 ms for
a thousand documents. Run on the forward thread, every search queued meanwhile waited for it;
here the forward and answer stages go on while it runs, and the index lets searches through
until it swaps the new generation in (:mod:`qswap.index.backends.faiss.commit`). The thread
keeps the normal CPU priority: a commit holds the index's change lock and, briefly, its
readers' lock, which a thread at the bulk lane's nice value could hold for long under load.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from qswap.server.serving.work import STOP, Call


class WriteLane:
    """One thread running :class:`Call` items with ``run`` in the order they were put."""

    def __init__(self, run: Callable[[Call], None], name: str) -> None:
        self._run = run
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def put(self, call: Call) -> None:
        """Queue ``call`` behind the writes already queued (any thread)."""
        self._q.put(call)

    def stop(self, timeout: float) -> list[Call]:
        """Let the write in progress end (up to ``timeout`` s) and return the calls still queued,
        which were not run (the caller refuses them)."""
        left: list[Call] = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Call):
                left.append(item)
        self._q.put(STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return left

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is STOP:
                return
            self._run(item)   # answers its caller and never raises (MicroBatcher._do_call)
