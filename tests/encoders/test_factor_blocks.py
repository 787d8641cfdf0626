"""An encoder's packed factors are the process's own memory, given back when dropped."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from qswap.bench.processes import rss_parts
from qswap.encoders.factor_blocks import pack_tensors

MIB = 1 << 20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_packed_factors_are_private_memory_given_back_whole():
    # 64 MiB of factors: what the memory budget counts must show as the process's anonymous
    # memory (not shared memory, which a forked child keeps mapped), and leave with the encoder.
    sources = [torch.full((512, 512), float(i)) for i in range(64)]   # 1 MiB each
    before = rss_parts(os.getpid())
    packed = pack_tensors(sources)
    held = rss_parts(os.getpid())
    assert all(torch.equal(p, s) for p, s in zip(packed, sources))
    assert held["anon"] - before["anon"] >= 60 * MIB
    assert held.get("shmem", 0) - before.get("shmem", 0) < 1 * MIB
    del packed
    gc.collect()
    after = rss_parts(os.getpid())
    assert after["anon"] - before["anon"] < 4 * MIB
