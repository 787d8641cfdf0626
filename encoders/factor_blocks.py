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
the encoder unmaps all of it at once. The shared runtime's float32 copies of half-precision
factors (:class:`~qswap.encoders.runtime.shared_run.WideFeeds`) are packed the same way, one
mapping per copy, so the copies dropped while encoders rotate through them leave no holes either.
"""

from __future__ import annotations

import mmap

import torch

from qswap.encoders.kinds.base import LowRank

ALIGN = 64   # each tensor starts on a cache line (what torch's CPU allocator gives too)


def pack_tensors(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` (converted to ``dtype``, default each one's own) as contiguous views
    of one page-rounded anonymous mapping, kept alive by the views: they cost exactly the
    mapping's bytes, and dropping the last view unmaps all of it at once."""
    if not tensors:
        return []
    size = sum(-(-t.numel() * (dtype or t.dtype).itemsize // ALIGN) * ALIGN for t in tensors)
    size = max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    # Private: the process's own memory (RssAnon). Python's default, a shared anonymous mapping, is
    # shared memory (RssShmem), which a forked child would keep mapped after the encoder is dropped.
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block = torch.frombuffer(mapping, dtype=torch.uint8)   # the views hold the mapping
    out, offset = [], 0
    for t in tensors:
        kind = dtype or t.dtype
        n = t.numel() * kind.itemsize
        view = block[offset:offset + n].view(kind).view(t.shape)
        view.copy_(t.detach())   # converts to ``kind`` on the way
        offset += -(-n // ALIGN) * ALIGN
        out.append(view)
    return out


def pack(factors: dict[str, LowRank]) -> dict[str, LowRank]:
    """The same factors (values, types, shapes) as contiguous views of one page-rounded anonymous
    mapping (:func:`pack_tensors`); factors off the CPU are returned as they are."""
    tensors = [t for f in factors.values() for t in (f.a, f.b)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return factors
    views = iter(pack_tensors(tensors))
    return {m: LowRank(a=next(views), b=next(views)) for m in factors}
