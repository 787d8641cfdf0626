"""Documents through the gathered forward (the ``cuda`` document runtime), one batch in flight.

The document tower is the base alone: the gathered forward (:mod:`qswap.encoders.runtime.gathered`)
with a two-slot table at rank 0 (every row the base's slot), so documents and queries run the
same code, SDPA attention included, in fp32, fp16 or bf16. Batches are large (a token budget of
:data:`GPU_MAX_TOKENS`: kernel launches amortise over many rows, so no graph is captured) and
asynchronous: :meth:`GpuDocuments.submit` copies a batch in from pinned memory, queues its forward
and the copy of its vectors out, and returns at once; the caller finishes the previous batch
meanwhile, so the GPU never waits on Python between batches (tokenisation runs ahead on a
producer thread: :mod:`qswap.encoders.runtime.documents`). On a CPU the same calls run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from qswap.encoders.base import BaseEncoder
from qswap.encoders.runtime.adapter_table import AdapterTable
from qswap.encoders.runtime.cuda import CUDA_PRECISIONS
from qswap.encoders.runtime.gathered import GatheredForward

#: Padded tokens per document batch on the cuda runtime (the CPU runtimes use 8,192).
GPU_MAX_TOKENS = 65536
#: Texts tokenised per window on the cuda runtime: batches sort by length within a window.
GPU_WINDOW = 8192


class GpuDocuments:
    """The base's document forward at ``precision`` on the base's device.

    Args:
        base: the frozen base.
        precision: ``fp32``, ``fp16`` or ``bf16``.
    """

    def __init__(self, base: BaseEncoder, precision: str = "fp32") -> None:
        self.device = base.device
        table = AdapterTable(base.model, capacity=2, max_rank=1, dtype=CUDA_PRECISIONS[precision], device=base.device)
        self.forward = GatheredForward(base.model, base.spec, table)
        self.cuda = self.device.type == "cuda"

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def submit(self, ids: np.ndarray, mask: np.ndarray) -> Callable[[], np.ndarray]:
        """Queue the batch (``ids``, ``mask``: (n, L) int64) and return ``finish()``, which waits
        for it and gives its (n, dim) float32 vectors."""
        with torch.inference_mode():
            t_ids, t_mask = self._to_device(ids), self._to_device(mask)
            slots = torch.zeros(ids.shape[0], dtype=torch.long, device=self.device)
            v = self.forward(t_ids, t_mask, slots, 0)
            if not self.cuda:
                out = v.numpy()
                return lambda: out
            host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            host.copy_(v, non_blocking=True)
            done = torch.cuda.Event()
            done.record()

        def finish() -> np.ndarray:
            done.synchronize()
            return host.numpy()
        return finish
