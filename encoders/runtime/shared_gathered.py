"""One ONNX Runtime call for a batch of any mix of encoders: each row's adapter gathered from a table.

The CPU analogue of punica's BGMV and S-LoRA's heterogeneous batches (on a GPU the CUDA
backend's :mod:`qswap.encoders.runtime.adapter_table` does the same in torch). The gathered graph
(:func:`qswap.encoders.runtime.shared_export.export_shared` with ``gathered=True``) takes every
adapter input per row; :class:`GatheredTable` holds the encoders that run on it stacked, one
slot each, and a call takes each row's slot into preallocated buffers (``numpy.take``), the LoRA
factors cut to the batch's largest rank. Zeros beyond a slot's own rank are exact, so rows of
two ranks, bias-only rows and rows of the base itself (zero factors, the base's biases) share
one call.

Layout, per Linear ``m`` of the shared graph's :class:`~qswap.encoders.runtime.shared_export.Slots`:
``m.lora_A`` (slots, rank, in) and ``m.lora_B`` (slots, rank, out) in the pool's factor storage
type (the graph casts to float32), ``m.bias`` (slots, 1, out) float32; per LayerNorm ``m.bias``
(slots, 1, width). Rank is the second axis so that a slot's first ``r`` rows are one contiguous
block: cutting the table to a batch's rank copies whole blocks. The torch table's layout (query,
key and value fused, block-diagonal factors) belongs to its own forward; this one follows the
ONNX graph's inputs, one per module.

What it costs: a slot holds an encoder's factors padded to the table's rank (a copy beside the
pool's), and the buffers hold rows x one encoder's factors at the batch's rank (the graph reads
each row's own factors: that is the price of one call per batch on a CPU, where no kernel
indexes the table in place).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from qswap.encoders.runtime.onnx_export import OUTPUT
from qswap.encoders.runtime.shared_export import Slots

# Slots a table starts with; it doubles when full.
START_SLOTS = 4


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy (bfloat16 as its int16 bits: numpy has no bfloat16)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class GatheredTable:
    """Every encoder run on the gathered graph, stacked; thread-safe.

    Args:
        slots: the graph's adapter slots.
        base: the base's own inputs (:meth:`Slots.base_inputs`): slot 0, and what every slot
            starts from.
        factor_dtype: the storage type of the LoRA factor inputs (float32, float16, bfloat16).
    """

    def __init__(self, slots: Slots, base: dict[str, torch.Tensor], factor_dtype: torch.dtype) -> None:
        from onnx import TensorProto

        self.names = slots.input_names()
        self._width = {f"{m}.{leaf}": (i if leaf == "lora_A" else o)
                       for m, i, o in slots.linear for leaf in ("lora_A", "lora_B", "bias")}
        self._width.update({f"{m}.bias": d for m, d in slots.norm})
        self._factor_np = _array(torch.zeros(1, dtype=factor_dtype)).dtype
        self._onnx_type = TensorProto.BFLOAT16 if factor_dtype == torch.bfloat16 else None
        self.capacity, self.rank = 0, 0
        self.tables: dict[str, np.ndarray] = {}
        self._buffers: dict[str, np.ndarray] = {}
        self._keys: dict[str, int] = {}
        self._ranks: list[int] = []
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._grow(START_SLOTS, 0)
        self._write(0, base)
        self._free.remove(0)

    # -- slots ----------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def slot(self, key: str) -> int | None:
        """The slot of ``key``, or ``None`` (slot 0, the base, has no key)."""
        return self._keys.get(key)

    def put(self, key: str, inputs: dict[str, torch.Tensor]) -> int:
        """Write ``key``'s full input set (the shared graph's layout: base inputs overlaid with
        the encoder's own) into a free slot, or its own; returns the slot."""
        rank = max((t.shape[0] for n, t in inputs.items() if n.endswith(".lora_A")), default=0)
        with self._lock:
            s = self._keys.get(key)
            if s is None:
                if not self._free:
                    self._grow(2 * self.capacity, self.rank)
                s = self._free.pop()
            if rank > self.rank:
                self._grow(self.capacity, rank)
            self._write(s, inputs)
            self._keys[key] = s
            return s

    def discard(self, key: str) -> None:
        """Free ``key``'s slot (overwritten by the next :meth:`put`)."""
        with self._lock:
            s = self._keys.pop(key, None)
            if s is not None:
                self._free.append(s)

    def nbytes(self) -> int:
        """Bytes of the table and of the call buffers."""
        return sum(a.nbytes for a in (*self.tables.values(), *self._buffers.values()))

    def _grow(self, capacity: int, rank: int) -> None:
        """Reallocate to ``capacity`` slots of rank ``rank``, keeping what the slots hold."""
        for name, w in self._width.items():
            factor = not name.endswith(".bias")
            shape = (capacity, rank if factor else 1, w)
            new = np.zeros(shape, dtype=self._factor_np if factor else np.float32)
            old = self.tables.get(name)
            if old is not None:
                new[:old.shape[0], :old.shape[1]] = old
            self.tables[name] = new
        self._free += list(range(capacity - 1, self.capacity - 1, -1))
        self._ranks += [0] * (capacity - self.capacity)
        self.capacity, self.rank = capacity, rank

    def _write(self, s: int, inputs: dict[str, torch.Tensor]) -> None:
        rank = 0
        for name, t in inputs.items():
            table = self.tables[name]
            if name.endswith(".bias"):
                table[s, 0] = _array(t.float())
                continue
            a = _array(t if name.endswith(".lora_A") else t.t())   # B: (out, r) in the pool, (r, out) here
            r = a.shape[0]
            table[s, :r] = a
            table[s, r:] = 0
            rank = max(rank, r)
        self._ranks[s] = rank

    # -- a call ---------------------------------------------------------------------------------

    def run(self, session: Any, emb: np.ndarray, mask: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Pooled embeddings of one padded batch, row ``i`` with the adapter of slot ``slots[i]``:
        ``emb`` (n, L, d) float32, ``mask`` (n, L) int64. One call; the buffers are this table's,
        so calls run one at a time."""
        import onnxruntime as ort

        slots = np.ascontiguousarray(slots, dtype=np.int64)
        n = len(slots)
        with self._lock:
            rank = max(self._ranks[s] for s in slots)
            binding = session.io_binding()
            for name in self.names:
                table = self.tables[name]
                factor = not name.endswith(".bias")
                rows = rank if factor else 1
                size = n * rows * table.shape[2]
                buf = self._buffers.get(name)
                if buf is None or buf.size < size:
                    buf = self._buffers[name] = np.empty(size, dtype=table.dtype)
                out = buf[:size].reshape(n, rows, table.shape[2])
                # mode="clip": "raise" buffers the whole result before writing it to ``out``
                np.take(table[:, :rows], slots, axis=0, out=out, mode="clip")
                value = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, self._onnx_type)
                         if factor and self._onnx_type is not None else ort.OrtValue.ortvalue_from_numpy(out))
                binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_input("inputs_embeds", ort.OrtValue.ortvalue_from_numpy(emb))
            binding.bind_ortvalue_input("attention_mask", ort.OrtValue.ortvalue_from_numpy(mask))
            binding.bind_output(OUTPUT)
            session.run_with_iobinding(binding)
            return binding.copy_outputs_to_cpu()[0]
