"""An encoder's LoRA factors in one block of memory of its own.

A LoRA encoder of multilingual-e5-small is ~150 small tensors (12-48 KiB each at r=16, float16).
Allocated one by one, they land in the process heap between the float32 copies made while
loading (the file's tensors, the validated copies, the rounding checks), which are freed right
after: the heap keeps those pages, and a freed encoder's factors leave holes that the next one
only partly fills. That is memory an encoder costs but no count of its tensors shows (about
0.3-0.7 MiB per encoder, growing with load/evict churn: bench/results/scale/).

:func:`pack` copies the factors into one anonymous memory mapping per encoder, page-rounded,
the tensors views of it: the encoder then costs exactly the mapping's bytes (what
:meth:`~qswap.encoders.kinds.base.AdapterKind.nbytes` counts, storage by storage), and dropping
the encoder unmaps all of it at once.
"""

from __future__ import annotations

import mmap

import torch

from qswap.encoders.kinds.base import LowRank

ALIGN = 64   # each tensor starts on a cache line (what torch's CPU allocator gives too)


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def pack(factors: dict[str, LowRank]) -> dict[str, LowRank]:
    """The same factors (values, types, shapes) as contiguous views of one page-rounded anonymous
    mapping, kept alive by the views; factors off the CPU are returned as they are."""
    tensors = [t for f in factors.values() for t in (f.a, f.b)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return factors
    size = sum(_padded(t) for t in tensors)
    size = max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    block = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)   # the views hold the mapping

    offset = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        n = t.numel() * t.element_size()
        view = block[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        offset += _padded(t)
        return view

    return {m: LowRank(a=place(f.a), b=place(f.b)) for m, f in factors.items()}
