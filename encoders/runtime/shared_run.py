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
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from qswap.encoders.factor_blocks import pack_tensors
from qswap.encoders.runtime.cancel import run_options
from qswap.encoders.runtime.export_digest import OUTPUT
from qswap.encoders.runtime.shared_export import ort_input

#: Bytes of float32 factor copies a CPU backend over a half-precision pool keeps (:class:`WideFeeds`):
#: ~10.6 MB per LoRA r=32 on every Linear of multilingual-e5-small, so the last 12 such encoders served.
WIDE_BYTES = 128 * 2**20


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

    def run(self, session: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The pooled embeddings of one batch: ``inputs`` are the graph's run-time inputs (the padded
        graph's ``inputs_embeds`` and ``attention_mask``, or the packed graph's
        :data:`~qswap.encoders.runtime.packed_export.PACKED_INPUTS`)."""
        import onnxruntime as ort

        with self._lock:
            _, free = self._free.setdefault(id(session), (session, []))   # the session kept: ids stay unique
            binding = free.pop() if free else None
        if binding is None:
            binding = session.io_binding()
            for name, value in self.feed.items():
                binding.bind_ortvalue_input(name, value)
        try:
            for name, value in inputs.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
            # Rebound every run: an output left bound keeps the last run's shape, and ONNX
            # Runtime refuses a run whose batch size differs from it.
            binding.bind_output(OUTPUT)
            session.run_with_iobinding(binding, run_options())   # a bulk pass can be stopped (cancel.py)
            return binding.copy_outputs_to_cpu()[0]
        finally:
            binding.clear_binding_outputs()
            with self._lock:
                free.append(binding)


class WideFeed(BoundFeed):
    """An encoder whose LoRA factors the pool keeps in half precision, on the graph that takes
    float32 factors: each run binds float32 copies of them, kept in ``cache`` (:class:`WideFeeds`)
    while it is among the encoders served last.

    Why: a graph that takes half-precision factors casts them to float32 in every run (146
    Cast nodes, ~10 % of a 16-token query, bench/results/forward_shared/); a copy made on a
    miss converts the same bytes once. ``feed`` holds the base's values and the encoder's own
    tensors (what :meth:`qswap.encoders.runtime.shared.SharedBackend.memory_bytes` counts); the
    bound values are the copy's.
    """

    def __init__(self, own: dict[str, torch.Tensor], base_values: dict[str, Any], cache: "WideFeeds") -> None:
        super().__init__({**base_values, **own})
        self.own, self._base_values, self._cache = own, base_values, cache
        half = [t for t in own.values() if t.dtype in (torch.float16, torch.bfloat16)]
        self.nbytes = sum(t.numel() * 4 for t in half)
        # Its copy can take over another's buffers (and bindings) only if every own tensor is a
        # copy (a float32 one is bound in place: a pool tensor, never to be overwritten).
        self.shapes = tuple((n, tuple(t.shape)) for n, t in own.items()) if len(half) == len(own) else None

    def run(self, session: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self._cache.run(self, session, inputs)

    def widen(self, into: dict[str, torch.Tensor] | None = None) -> tuple[BoundFeed | None, dict[str, torch.Tensor]]:
        """float32 copies of the half-precision tensors: new ones and a feed over them, or
        written into ``into`` (another entry's copies of the same shapes: their feed is reused)."""
        if into is not None:
            for n, t in self.own.items():
                into[n].copy_(t)
            return None, into
        # One mapping per copy (qswap.encoders.factor_blocks): a copy dropped from the cache is unmapped
        # whole, instead of leaving ~150 holes in the heap of whichever thread made it.
        half = [n for n, t in self.own.items() if t.dtype in (torch.float16, torch.bfloat16)]
        copies = dict(zip(half, pack_tensors([self.own[n] for n in half], torch.float32)))
        wide = {n: copies.get(n, t) for n, t in self.own.items()}
        return BoundFeed({**self._base_values, **{n: ort_input(t) for n, t in wide.items()}}), wide


class WideFeeds:
    """The float32 feeds of the :class:`WideFeed` s served last, at most ``capacity`` bytes of
    copies (least recently served dropped first); thread-safe.

    A miss when full takes over the least recently served copy if it has the same shapes and no
    run holds it: its buffers are overwritten and its bindings kept, so an encoder served in a
    rotation wider than the capacity costs one conversion per run (what the casts cost), not an
    allocation and ~240 bindings.
    """

    def __init__(self, capacity: int = WIDE_BYTES) -> None:
        self.capacity = capacity
        # entry -> [feed, its copies, runs holding it]
        self._held: OrderedDict[WideFeed, list[Any]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def run(self, entry: WideFeed, session: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """One run of ``entry`` on its float32 feed (held, taken over, or new)."""
        slot = self._acquire(entry)
        try:
            return slot[0].run(session, inputs)
        finally:
            with self._lock:
                slot[2] -= 1

    def _acquire(self, entry: WideFeed) -> list[Any]:
        with self._lock:
            slot = self._held.get(entry)
            if slot is not None:
                self._held.move_to_end(entry)
                slot[2] += 1
                return slot
            victim = None
            if self._held and self._bytes + entry.nbytes > self.capacity:
                old, (feed, wide, users) = next(iter(self._held.items()))
                if users == 0 and entry.shapes is not None and old.shapes == entry.shapes:
                    victim = self._held.pop(old)
                    self._bytes -= old.nbytes
            slot = victim or [None, None, 0]
            slot[2] = 1   # held by this run: never taken over while converting
        feed, wide = entry.widen(slot[1])
        with self._lock:
            slot[0], slot[1] = feed or slot[0], wide
            if entry.nbytes <= self.capacity and entry not in self._held:
                self._held[entry] = slot
                self._bytes += entry.nbytes
                while self._bytes > self.capacity:
                    old, _ = self._held.popitem(last=False)
                    self._bytes -= old.nbytes
        return slot

    def discard(self, entry: Any) -> None:
        """Drop ``entry``'s copy (its encoder was discarded or prepared again)."""
        with self._lock:
            if self._held.pop(entry, None) is not None:
                self._bytes -= entry.nbytes

    def nbytes(self) -> int:
        """Bytes of the float32 copies held now (at most ``capacity``)."""
        with self._lock:
            return self._bytes


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


def run_calls(calls: list[tuple[BoundFeed, list[int], np.ndarray, np.ndarray]], call: Any, out: np.ndarray,
              session: Any, group_session: Any, workers: Any, group_workers: int, *, groups: int, bulk: bool) -> None:
    """Run a batch's calls (``(feed, rows, ids, mask)``: one per encoder group and length bucket) into
    ``out``: a bulk pass's on the single-threaded ``group_session`` in the calling thread (``session``
    until that one is built); calls of several groups side by side on it through ``workers`` when
    :func:`spread_groups` says so; otherwise one after another on the multi-threaded ``session``.
    ``call(session, feed, ids, mask)``: one ONNX Runtime call's embeddings."""
    if bulk:
        for feed, rows, ids, mask in calls:
            out[rows] = call(group_session or session, feed, ids, mask)
    elif group_session is not None and spread_groups([c[2].size for c in calls], groups, group_workers):
        # Longest first, so the short calls fill the workers' gaps at the end.
        calls.sort(key=lambda c: -c[2].size)
        futures = [workers.submit(call, group_session, c[0], c[2], c[3]) for c in calls]
        for (_, rows, _, _), f in zip(calls, futures):
            out[rows] = f.result()
    else:
        for feed, rows, ids, mask in calls:
            out[rows] = call(session, feed, ids, mask)


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

