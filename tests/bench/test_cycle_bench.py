"""``qswap bench cycle``: py-spy's collapsed stacks summarised per thread and per frame."""

from __future__ import annotations

import pytest

from qswap.bench.cycle import collapse


def test_collapse_counts_threads_own_and_inclusive_frames():
    raw = "\n".join([
        "thread (0x1): qswap-batcher;_run (b.py:1);run (s.py:2) 6",
        "thread (0x2): qswap-batcher-answers;_answer_loop (b.py:3);search (f.py:4) 2",
        "thread (0x3): AnyIO worker thread_1;work (w.py:5) 1",
        "thread (0x4): AnyIO worker thread_2;work (w.py:5) 1",
        "not a stack line",
    ])
    got = collapse(raw)
    assert got["samples"] == 10
    assert got["threads"] == {"qswap-batcher": 0.6, "qswap-batcher-answers": 0.2, "AnyIO worker thread": 0.2}
    assert got["self"][0] == ["run (s.py:2)", 0.6]
    assert dict(map(tuple, got["inclusive"]))["_run (b.py:1)"] == pytest.approx(0.6)
    assert collapse("")["samples"] == 0 and collapse("")["self"] == []


def test_cpu_seconds_counts_this_process_work():
    import os
    import time

    from qswap.bench.cycle import cpu_seconds

    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.05   # busy: the kernel's tick counts it (10 ms resolution)
    while time.process_time() < end:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.03
