"""Forward passes of the server's own background work (guard evaluations) through the cost gate.

The guard encodes every sentinel query of a new encoder (and of the encoders it is compared
with) on its own thread. Calling the backend from that thread would run a second forward pass
beside the batch worker's, on the same cores and outside every bound a request has. Instead
:class:`GatedEncode` submits each chunk to the batch worker as a job with a background
:class:`~qswap.server.serving.admission.Ticket`: the chunk is counted, sliced and interleaved
with the searches like any request, under the same admission bound.

The worker answers a job on the submitter's event loop; the guard thread has none, so each
calling thread keeps one private loop to wait on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import numpy as np

from qswap.errors import NotReadyError, OverloadedError
from qswap.guard.evaluator import EvaluationCancelled
from qswap.server.serving.admission import Ticket
from qswap.server.serving.batching import MicroBatcher

# An overloaded worker (its admission bound full of requests) refuses the chunk: background
# work yields to requests and asks again a little later rather than failing the evaluation.
_RETRY_S = 0.05


class GatedEncode:
    """``encode(texts, keys)`` for a worker thread, run as batch-worker jobs (module docstring).

    Args:
        batcher: the server's batch worker.
        closing: set when the server stops: a chunk refused because the worker is shutting down,
            or waiting for room then, ends the evaluation with :class:`EvaluationCancelled`.
    """

    def __init__(self, batcher: MicroBatcher, closing: Callable[[], bool] = lambda: False) -> None:
        self.batcher = batcher
        self._closing = closing
        self._local = threading.local()

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = getattr(self._local, "loop", None)
        if loop is None:
            loop = self._local.loop = asyncio.new_event_loop()
        return loop

    def __call__(self, texts: list[str], keys: list[str]) -> np.ndarray:
        """The vectors of ``texts``, row i encoded by ``keys[i]`` (rows grouped by encoder)."""
        if len(texts) != len(keys):
            raise ValueError("one key per text")
        out: np.ndarray | None = None
        for key in dict.fromkeys(keys):
            rows = [i for i, k in enumerate(keys) if k == key]
            vecs = self._one(key, [texts[i] for i in rows])
            if out is None:
                out = np.empty((len(texts), vecs.shape[1]), dtype=np.float32)
            out[rows] = vecs
        return out if out is not None else np.empty((0, 0), dtype=np.float32)

    def _one(self, key: str, texts: list[str]) -> np.ndarray:
        loop = self._loop()
        while True:
            try:
                outcome = loop.run_until_complete(self.batcher.embed(texts, key, ticket=Ticket()))
                return np.asarray(outcome.vectors, dtype=np.float32)
            except NotReadyError as e:
                raise EvaluationCancelled("the guard evaluation was cancelled: the server is shutting down",
                                          "a restart evaluates the encoder again") from e
            except OverloadedError:
                if self._closing():
                    raise EvaluationCancelled("the guard evaluation was cancelled: the server is shutting down",
                                              "a restart evaluates the encoder again") from None
                time.sleep(_RETRY_S)
