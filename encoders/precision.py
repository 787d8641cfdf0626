"""Reduced-precision (bf16) forward passes for document embedding and batched queries.

bf16 keeps fp32's exponent range, so a BERT-family encoder runs under ``torch.autocast``
without scaling tricks: matrix products run in bf16, layer norms and softmax stay in fp32
(autocast's own op lists). It pays only where the hardware multiplies bf16 natively: Intel
AMX, AVX-512 BF16 (e.g. AMD Zen 4/5), or NVIDIA tensor cores (compute capability >= 8.0).
Elsewhere it is emulated and slower than fp32, which is why :func:`has_fast_bf16` exists.

fp32 is the default everywhere; ``bf16`` changes embeddings slightly (cosine to fp32 is
measured by ``qswap bench forward``), so an index built with it should be evaluated first.

Use::

    with autocast_context(base.device, "bf16"):
        docs = base.encode_documents(texts)        # float32 output, bf16 matmuls inside
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager

from qswap.errors import InvalidInputError

if TYPE_CHECKING:   # imported by the functions that use it: the CLI reads PRECISIONS without torch
    import torch

log = logging.getLogger("qswap.encoders")

PRECISIONS = ("fp32", "bf16")

#: Smallest batch of queries that ``qswap serve --query-precision bf16`` runs in bf16. Autocast
#: re-casts weights and activations on every call, a cost only larger batches repay: with
#: e5-small on 2 AMX cores (``qswap bench forward --batch-reps 15``, "Query batches"), 16-token
#: queries in bf16 ran at 0.67x the fp32 speed alone, 0.91x in 8s, 1.16x in 16s, 1.32x in 32s.
BF16_MIN_QUERY_BATCH = 16

# /proc/cpuinfo flags of CPUs with native bf16 dot products (AMX tiles or AVX-512 BF16).
_CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def check_precision(precision: str) -> str:
    """Return ``precision`` if it is a known one, else raise :class:`InvalidInputError`."""
    if precision not in PRECISIONS:
        raise InvalidInputError(f"unknown precision {precision!r}", f"use one of {', '.join(PRECISIONS)}")
    return precision


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The native-bf16 CPU flags present (``amx_bf16``, ``avx512_bf16``); empty if none or unknown."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:   # not Linux, or /proc not mounted: assume nothing rather than guess
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return tuple(f for f in _CPU_BF16_FLAGS if f in flags)
    return ()


def has_fast_bf16(device: torch.device | str | None = None) -> bool:
    """Whether ``device`` multiplies bf16 natively (default: CUDA if present, else the CPU).

    CUDA: bf16 tensor cores (compute capability >= 8.0). CPU: AMX or AVX-512 BF16 in
    ``/proc/cpuinfo``.
    """
    import torch

    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index)[0] >= 8
    if dev.type == "cpu":
        return bool(cpu_bf16_flags())
    return False


def autocast_context(device: torch.device | str, precision: str = "fp32") -> ContextManager[object]:
    """A context manager running torch forwards on ``device`` at ``precision``.

    ``fp32`` is a no-op; ``bf16`` is ``torch.autocast(device.type, dtype=torch.bfloat16)``.
    Raises :class:`InvalidInputError` for an unknown precision or a device without autocast.
    The context is thread-local, like autocast itself: wrap the call that encodes.
    """
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    import torch

    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"bf16 autocast is not supported on device {dev}",
                                "use precision fp32 on this device")
    if not has_fast_bf16(dev):
        warn_emulated(str(dev.type))
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def warn_emulated(device_type: str) -> None:
    """Warn (once per device type) that bf16 is emulated, hence slower than fp32, here."""
    # Once per device type: on an AVX2-only CPU (e.g. AMD Zen 3) bf16 matrix products were
    # measured ~7x slower than fp32, a silent slowdown nobody asking for speed would want.
    log.warning("bf16 requested on a %s without native bf16 (AMX, AVX-512-BF16 or tensor cores): it is "
                "emulated and slower than fp32 here; use precision fp32 on this machine", device_type)
