"""How the shared graph is run: adapter inputs bound once, encoder groups side by side.

Two costs decide how fast a batch that mixes encoders runs (multilingual-e5-small, LoRA r=32 on
every Linear, 2 cores; README "Fast query path"):

- Passing an encoder's ~240 adapter inputs as a feed dict costs ~2.5 ms per ONNX Runtime call
  (14.4 vs 11.9 ms for one 16-token query): :class:`BoundFeed` binds them once per session in an
  ``IOBinding``, so a call binds only the token embeddings and the mask.
- A batch runs one call per encoder group on this graph (it takes one encoder's inputs; the
  segment graph, :mod:`qswap.encoders.runtime.shared_segments`, takes several). Those calls are
  small, and on one multi-threaded session they run one after another with poor use of the
  cores; spread over as many single-threaded
  sessions' runs as there are cores (:func:`spread_groups`), 8 encoders' rows cost what one
  call for a single encoder's 8 rows costs.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from qswap.encoders.runtime.cancel import run_options
from qswap.encoders.runtime.onnx_export import OUTPUT


class BoundFeed:
    """One encoder's adapter inputs (``OrtValue`` s, views of the pool's tensors), bound per session.

    Thread-safe: each concurrent run takes its own ``IOBinding`` from a small free list (a binding
    is mutable state: two runs must not share one); one that finds none binds a new one, kept
    for the next run.
    """

    def __init__(self, feed: dict[str, Any]) -> None:
        self.feed = feed   # keeps the OrtValues (and the numpy arrays under them) alive
        self._free: dict[int, tuple[Any, list[Any]]] = {}
        self._lock = threading.Lock()

    def run(self, session: Any, emb: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The pooled embeddings of one padded batch: ``emb`` (n, L, d) float32, ``mask`` (n, L) int64."""
        import onnxruntime as ort

        with self._lock:
            _, free = self._free.setdefault(id(session), (session, []))   # the session kept: ids stay unique
            binding = free.pop() if free else None
        if binding is None:
            binding = session.io_binding()
            for name, value in self.feed.items():
                binding.bind_ortvalue_input(name, value)
        try:
            binding.bind_ortvalue_input("inputs_embeds", ort.OrtValue.ortvalue_from_numpy(emb))
            binding.bind_ortvalue_input("attention_mask", ort.OrtValue.ortvalue_from_numpy(mask))
            # Rebound every run: an output left bound keeps the last run's shape, and ONNX
            # Runtime refuses a run whose batch size differs from it.
            binding.bind_output(OUTPUT)
            session.run_with_iobinding(binding, run_options())   # a bulk pass can be stopped (cancel.py)
            return binding.copy_outputs_to_cpu()[0]
        finally:
            binding.clear_binding_outputs()
            with self._lock:
                free.append(binding)


def spread_groups(call_tokens: list[int], groups: int, workers: int) -> bool:
    """Whether a batch's calls (padded tokens each) should run side by side on ``workers``
    single-threaded sessions instead of one after another on the multi-threaded one.

    Only for batches of two or more encoder groups: one encoder's rows are one call already,
    and a single-threaded session runs one call ~1.4-1.9x slower than the multi-threaded one,
    so spreading pays only when the other workers have comparable work to do meanwhile. Hence
    the largest call must hold at most half of the batch's tokens; with one group that big
    (30 rows of one encoder and 2 of another), running it single-threaded would cost more than
    the other calls' overhead saves.
    """
    return workers > 1 and groups > 1 and len(call_tokens) > 1 and 2 * max(call_tokens) <= sum(call_tokens)


#: ``mix="auto"`` runs a mixed batch as one segment call when its encoder groups average fewer
#: rows than this (bench/results/forward_mixed/: one segment call was faster than the groups
#: with 1 to 2 rows per encoder, level at 4, slower at 8).
SEGMENTS_BELOW_ROWS_PER_GROUP = 4


def segment_groups(rows: int, groups: int) -> bool:
    """Whether a batch of ``rows`` rows over ``groups`` encoders runs as one segment call under
    ``mix="auto"``: only when it mixes encoders and its groups are small, where one call per
    group costs more in calls than the segment call costs in routing tokens and copying factors."""
    return groups > 1 and rows < SEGMENTS_BELOW_ROWS_PER_GROUP * groups


def await_build(future: Any, wait: float | None) -> None:
    """Wait up to ``wait`` seconds (``None``: as long as it takes, 0: not at all) for a background
    build; its outcome is read from what it built, so a timeout or a failure is not raised here."""
    if future is None or wait == 0:
        return
    try:
        future.result(timeout=wait)
    except Exception:  # noqa: BLE001 - the caller reads whether the build produced its session
        pass

