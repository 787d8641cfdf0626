"""One ONNX Runtime call for a batch of any mix of encoders: rows routed to their encoder's factors.

The CPU analogue of punica's SGMV (segment-gathered matrix-vector products): the segment graph
(:func:`qswap.encoders.runtime.shared_export.export_shared` with ``segments=True``) takes each
adapted Linear's LoRA factors once per encoder of the batch, ``<m>.lora_A`` (E, r, in) and
``<m>.lora_B`` (E, out, r), and two routing inputs
(:func:`~qswap.encoders.runtime.packing.segment_routing`): which tokens each encoder takes, and
where each token's product comes back from. Every Linear then computes ``x @ W.T`` for the whole
batch (one GEMM, as for one encoder), takes each encoder's tokens (one Gather, shared by
query/key/value), runs ``[E, M, in] @ [E, in, r] @ [E, r, out]`` (M: the largest encoder's
tokens) and routes the products back (one Gather). So a call copies each encoder's factors once,
not each row's, and the base's weights are read once for the whole batch.

On the CPU, for a base whose attention the packed graph fuses
(:func:`~qswap.encoders.runtime.packing.packable`), the graph is the packed one
(:mod:`~qswap.encoders.runtime.packed_export`, ``segments=True``): the batch's real tokens end to
end, each token routed to its encoder, so no pad token is computed or routed; elsewhere (CUDA,
other bases) it runs padded rows (:func:`~qswap.encoders.runtime.shared_export.export_shared`).

Ranks are zero-padded to the batch's largest per layer (exact), so rows of LoRA encoders of any
rank and of the base itself share one call. The biases are the base's, graph inputs fused into
SkipLayerNormalization / BiasGelu / MultiHeadAttention as in the shared graph: an encoder with
biases of its own (the bias kind) does not run here (:meth:`SegmentRunner.accepts`) but in its
own bound call. Per-row biases would cost an Add per layer on every row for every batch (the
gathered graph's way), ~6 % of a call, for a kind that has its own cheap path.

Memory: :class:`SegmentRunner` holds no table of encoders. Its call buffers hold the factors of
at most :data:`MAX_SEGMENTS` encoders at the batch's rank (a batch with more encoders runs as
several calls), so what they cost is fixed (:meth:`SegmentRunner.nbytes`), whatever the number
of loaded encoders; an encoder already in its slot from the last call is not copied again.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import numpy as np
import torch

from qswap.encoders.runtime.export_digest import OUTPUT
from qswap.encoders.runtime.packing import segment_routing
from qswap.encoders.runtime.shared_export import Slots, ort_input

#: The most encoders one segment call holds: bounds the call buffers (~5.3 MB per encoder at
#: LoRA r=32 on every Linear of multilingual-e5-small, float16).
MAX_SEGMENTS = 32


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy (bfloat16 as its int16 bits: numpy has no bfloat16)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class _Source:
    """What one encoder puts in a call: its factors per Linear (numpy views of the pool's tensors,
    in its storage type), and whether it has biases of its own (then it does not run here)."""

    def __init__(self, own: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
        self.factors = {name[:-len(".lora_A")]: (_array(t), _array(own[name[:-1] + "B"]))
                        for name, t in own.items() if name.endswith(".lora_A")}
        self.biased = any(name.endswith(".bias") and not torch.equal(t, base[name]) for name, t in own.items())

    def rank(self, module: str) -> int:
        f = self.factors.get(module)
        return 0 if f is None else f[0].shape[0]


class SegmentRunner:
    """Runs batches of any encoder mix on the segment graph; thread-safe (one call at a time).

    Args:
        slots: the graph's adapter slots.
        base: the base's own inputs (:meth:`Slots.base_inputs`): the biases bound to every call.
        factor_dtype: the storage type of the LoRA factor inputs (float32, float16, bfloat16): the
            pool's (float32 buffers on CPU removed the graph's Cast per factor but measured no
            faster end to end, and slower for a call whose encoders all change).
        packed: the session runs the packed segment graph (tokens routed end to end), not padded rows.
    """

    def __init__(self, slots: Slots, base: dict[str, torch.Tensor], factor_dtype: torch.dtype,
                 packed: bool = False) -> None:
        from onnx import TensorProto

        self.packed = packed
        self.linear = slots.linear
        self.norm = slots.norm
        self._base = base
        self._fixed = {n: ort_input(t) for n, t in base.items() if n.endswith(".bias")}
        self._factor_np = _array(torch.zeros(1, dtype=factor_dtype)).dtype
        self._onnx_type = TensorProto.BFLOAT16 if factor_dtype == torch.bfloat16 else None
        self._sources: dict[str, _Source] = {}
        # numpy, not torch: a cold call copies ~5,800 slices for 20 encoders, and a torch
        # copy_/zero_ costs several times a numpy slice assignment's overhead each
        self._buffers: dict[str, np.ndarray] = {}
        # per input: (shape it was last filled at, the key each slot holds), so a slot still holding
        # its key at the same shape is not copied again
        self._held: dict[str, tuple[tuple[int, ...], list[str | None]]] = {}
        self._order: list[str] = []   # the keys of the last call, in slot order
        # The binding of the last call's session, the biases bound once, and per factor input the
        # (address, shape) bound with the value kept alive: a call whose factors stay in the same
        # buffers at the same shapes binds only the routing, embeddings and mask (~240 inputs fewer).
        self._binding: tuple[Any, Any] | None = None
        self._bound: dict[str, tuple[tuple[int, tuple[int, ...]], Any]] = {}
        self._lock = threading.Lock()

    def accepts(self, key: str, own: Callable[[str], dict[str, torch.Tensor]]) -> bool:
        """Whether ``key`` runs here (no biases of its own); ``own`` gives its adapter tensors
        (the shared graph's names) the first time it is asked."""
        with self._lock:
            if key not in self._sources:
                self._sources[key] = _Source(own(key), self._base)
            return not self._sources[key].biased

    def discard(self, key: str) -> None:
        """Drop what is held for ``key`` (discarded, or prepared again with new tensors)."""
        with self._lock:
            self._sources.pop(key, None)
            for _, keys in self._held.values():
                for i, k in enumerate(keys):
                    if k == key:
                        keys[i] = None

    def nbytes(self) -> int:
        """Bytes of the call buffers (at most :data:`MAX_SEGMENTS` encoders at the largest rank run)."""
        return sum(b.nbytes for b in self._buffers.values())

    def run(self, session: Any, inputs: dict[str, np.ndarray], mask: np.ndarray, keys: list[str]) -> np.ndarray:
        """Pooled embeddings of one batch, row ``i`` with encoder ``keys[i]`` (at most
        :data:`MAX_SEGMENTS` distinct, each one :meth:`accepts`): ``inputs``, the graph's run-time
        inputs (:func:`~qswap.encoders.runtime.packing.graph_inputs`: packed tokens or padded
        rows, as the session's graph is), ``mask`` (n, L) the rows' padded mask."""
        import onnxruntime as ort

        with self._lock:
            order = self._slots(keys)
            if len(order) > MAX_SEGMENTS:
                raise ValueError(f"{len(order)} encoders in one segment call (at most {MAX_SEGMENTS})")
            sources = [self._sources[k] for k in order]
            if self._binding is None or self._binding[0] is not session:
                self._binding, self._bound = (session, session.io_binding()), {}
                for name, value in self._fixed.items():
                    self._binding[1].bind_ortvalue_input(name, value)
            binding = self._binding[1]
            slot = {k: e for e, k in enumerate(order)}
            segment = np.fromiter((slot[k] for k in keys), dtype=np.int64, count=len(keys))
            lengths = mask.sum(1) if self.packed else np.full(len(keys), mask.shape[1])
            for name, value in segment_routing(segment, len(order), lengths, self.packed).items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
            for m, i, o in self.linear:
                rank = max(s.rank(m) for s in sources)
                a = self._fill(f"{m}.lora_A", (rank, i), order, lambda s: s.factors.get(m, (None,))[0])
                b = self._fill(f"{m}.lora_B", (o, rank), order, lambda s: s.factors.get(m, (None, None))[1])
                for name, value in ((f"{m}.lora_A", a), (f"{m}.lora_B", b)):
                    where = (value.ctypes.data, value.shape)
                    if self._bound.get(name, (None,))[0] != where:
                        value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(value, self._onnx_type) \
                            if self._onnx_type is not None else ort.OrtValue.ortvalue_from_numpy(value)
                        binding.bind_ortvalue_input(name, value)
                        self._bound[name] = (where, value)
            for name, value in inputs.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
            # Rebound every run: an output left bound keeps the last run's shape (shared_run.BoundFeed).
            binding.bind_output(OUTPUT)
            try:
                session.run_with_iobinding(binding)
                return binding.copy_outputs_to_cpu()[0]
            finally:
                binding.clear_binding_outputs()

    def _slots(self, keys: list[str]) -> list[str]:
        """The call's encoders in slot order: one that held a slot in the last call keeps it if
        it fits, so its factors are still in the buffers."""
        distinct = list(dict.fromkeys(keys))
        n = len(distinct)
        order: list[str | None] = [None] * n
        rest = []
        for k in distinct:
            try:
                i = self._order.index(k)
            except ValueError:
                i = n
            if i < n and order[i] is None:
                order[i] = k
            else:
                rest.append(k)
        it = iter(rest)
        final = [k if k is not None else next(it) for k in order]
        self._order = final + [k for k in self._order[n:] if k not in final]
        return final

    def _fill(self, name: str, shape: tuple[int, int], order: list[str],
              pick: Callable[[_Source], np.ndarray | None]) -> np.ndarray:
        """The (E, *shape) factor ``name`` in its buffer: each slot's tensor converted to the graph's
        type and zero-padded (ranks to the batch's largest), slots that hold their key at this
        shape left as they are."""
        size = len(order) * shape[0] * shape[1]
        buf = self._buffers.get(name)
        if buf is None or buf.size < size:
            old = buf
            buf = self._buffers[name] = np.zeros(max(size, 0 if old is None else old.size), dtype=self._factor_np)
            self._held.pop(name, None)
        out = buf[:size].reshape(len(order), *shape)
        held_shape, held = self._held.get(name, ((), []))
        if held_shape != shape:
            held = []
        held += [None] * (len(order) - len(held))
        for e, k in enumerate(order):
            if held[e] == k:
                continue
            t = pick(self._sources[k])
            if t is None:
                out[e] = 0
            elif name.endswith(".lora_B"):   # (out, r): rank on the last axis
                out[e, :, :t.shape[1]] = t
                out[e, :, t.shape[1]:] = 0
            else:                            # A (r, in)
                out[e, :t.shape[0]] = t
                out[e, t.shape[0]:] = 0
            held[e] = k
        self._held[name] = (shape, held)
        return out


def encode_segments(session: Any, runner: SegmentRunner, groups: dict[str, list[int]],
                    own: Callable[[str], dict[str, torch.Tensor]],
                    buckets: Callable[[list[str], list[Any]], Iterable[tuple[list[int], np.ndarray, np.ndarray]]],
                    inputs_of: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
                    texts: list[str], encs: list[Any], out: np.ndarray) -> dict[str, list[int]]:
    """Run the rows of ``groups`` (key -> its rows) whose encoders the segment graph takes, in one
    call per length bucket (``buckets``: the backend's calls of some texts, cut for the session's
    graph, packed or padded) and per :data:`MAX_SEGMENTS` encoders, each row routed to its
    encoder's factors, into ``out``; returns the groups left to run per group (encoders with
    biases of their own: the segment graph takes the base's). ``own``: an encoder's adapter
    inputs; ``inputs_of``: the graph's run-time inputs of a bucket's padded ids and mask
    (:func:`~qswap.encoders.runtime.packing.graph_inputs`)."""
    keys = [k for k in groups if runner.accepts(k, own)]
    if len(keys) < 2:
        return groups
    for start in range(0, len(keys), MAX_SEGMENTS):
        key_of = {i: k for k in keys[start:start + MAX_SEGMENTS] for i in groups[k]}
        rows = list(key_of)
        for idx, ids, mask in buckets([texts[i] for i in rows], [encs[i] for i in rows]):
            picked = [rows[j] for j in idx]
            out[picked] = runner.run(session, inputs_of(ids, mask), mask, [key_of[i] for i in picked])
    return {k: r for k, r in groups.items() if k not in keys}
