"""Stopping a forward pass in the middle: ONNX Runtime's ``RunOptions.terminate`` for this thread.

A server's bulk lane runs one slice of a large request per pass (up to a 512-token row on one
core: ~0.2 s). When that request's client goes away (or its deadline passes) during the pass,
the rest of the pass is model time nobody reads. :func:`cancellable` gives the calling thread
a ``RunOptions`` that every ONNX Runtime call made on it takes (:func:`run_options`, read by
the shared graph and the document tower); :meth:`Cancel.stop`, from any thread, sets its
``terminate`` flag: ONNX Runtime stops the call between two nodes and raises.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

_local = threading.local()


class Cancel:
    """The stop switch of the passes run inside one :func:`cancellable` block."""

    def __init__(self, options: Any) -> None:
        self.options = options

    def stop(self) -> None:
        """Stop the pass running now (if any) and every later one of the block (any thread)."""
        self.options.terminate = True


@contextlib.contextmanager
def cancellable() -> Iterator[Cancel]:
    """ONNX Runtime calls on this thread inside the block can be stopped with the yielded
    :class:`Cancel` (a stopped call raises from ``session.run``)."""
    import onnxruntime as ort

    prev = getattr(_local, "options", None)
    _local.options = ort.RunOptions()
    try:
        yield Cancel(_local.options)
    finally:
        _local.options = prev


def run_options() -> Any:
    """The ``RunOptions`` of this thread's :func:`cancellable` block, or None outside one."""
    return getattr(_local, "options", None)
