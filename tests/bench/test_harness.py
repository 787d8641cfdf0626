"""Result files, provenance, percentile and ratio math, the interleaved runner, plots."""

from __future__ import annotations

import json
import math
import random

import pytest

from qswap.bench import plots, processes
from qswap.bench.results import ResultWriter, md_table
from qswap.bench.provenance import command_line
from qswap.bench.stats import interleaved, percentile, ratio_summary, summarize, timed_ms
from qswap.bench.plots import pareto_front
from qswap.errors import InvalidInputError


def test_percentile_matches_hand_computed_values():
    xs = [15, 20, 35, 40, 50]
    # rank = (n-1) q/100: q=40 -> 1.6 -> 20 + 0.6*15 = 29
    assert percentile(xs, 40) == pytest.approx(29.0)
    assert percentile(xs, 50) == 35
    assert percentile(xs, 0) == 15 and percentile(xs, 100) == 50
    assert percentile(xs, 95) == pytest.approx(40 + 0.8 * 10)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    # order of the input does not matter
    assert percentile([50, 15, 40, 35, 20], 40) == pytest.approx(29.0)


def test_percentile_agrees_with_numpy():
    import numpy as np
    rng = random.Random(3)
    for n in (2, 3, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (1, 25, 50, 90, 95, 99, 99.9):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_rejects_out_of_range():
    with pytest.raises(InvalidInputError):
        percentile([1, 2], 101)


def test_summarize():
    s = summarize(list(range(1, 101)))
    assert s["n"] == 100 and s["mean"] == 50.5 and s["min"] == 1 and s["max"] == 100
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)


def test_timed_ms_warms_then_times_each_call_between_syncs():
    calls: list[tuple[str, int]] = []
    times = timed_ms(lambda i: calls.append(("call", i)), 3, warm=2, sync=lambda: calls.append(("sync", -1)))
    assert calls == [("call", 0), ("call", 1)] + [("sync", -1), ("call", 0), ("sync", -1),
                                                    ("sync", -1), ("call", 1), ("sync", -1),
                                                    ("sync", -1), ("call", 2), ("sync", -1)]
    assert len(times) == 3 and all(t >= 0 for t in times)


def test_ratio_summary_pairs_rounds():
    r = ratio_summary([2, 4, 9, 5], [1, 2, 3, 0])   # last pair dropped (division by zero)
    assert r.ratios == [2.0, 2.0, 3.0] and r.n == 3
    assert r.median == 2.0 and r.min == 2.0 and r.max == 3.0
    assert r.p75 == pytest.approx(2.5)
    with pytest.raises(InvalidInputError):
        ratio_summary([1], [1, 2])


def test_interleaved_alternates_and_drops_warmup():
    calls = []
    arms = {"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or len(calls)}
    out = interleaved(arms, rounds=3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [4, 5, 8], "b": [3, 6, 7]}


def test_command_line_reads_as_typed():
    assert command_line(["/x/.venv/bin/qswap", "bench", "serving", "--quick"]) == "qswap bench serving --quick"
    assert command_line(["bench.py", "a b"]) == "bench.py 'a b'"


def test_md_table():
    t = md_table(["a", "b"], [[1, 0.123456], ["x|y", float("nan")]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.123 |", "| x\\|y | n/a |"]


def test_pareto_front():
    pts = [(1.0, 0.5), (2.0, 0.4), (3.0, 0.9), (0.5, 0.2), (3.0, 0.95), (5.0, 0.95)]
    assert pareto_front(pts) == [3, 0, 4]


def test_result_writer_contents(tmp_path):
    w = ResultWriter("demo", tmp_path / "demo", argv=["qswap", "bench", "demo", "--quick"])
    png = w.plot_path("lat.png")
    plots.plot_lines(png, [1, 2, 4], {"p50": [1.0, 2.0, 3.0]}, xlabel="c", ylabel="ms", title="t", logx=True,
                       vlines=[2.0], vlabel="event",
                       bands={"p50": ([0.5, 1.5, 2.5], [1.5, 2.5, 3.5])})
    plots.plot_bars(w.plot_path("bars.png"), ["x", "y"], {"s1": [1, 2], "s2": [3, 4]}, ylabel="v", title="t",
                      stacked=True)
    plots.plot_pareto(w.plot_path("pareto.png"), [(1, 0.5), (2, 0.9)], ["a", "b"], xlabel="ms", ylabel="r",
                        title="t")
    import numpy as np
    out = w.write({"qps": np.float32(12.5), "lat": np.array([1, 2]), "nan": float("nan")}, "## Body\n\ntext")
    doc = json.loads((out / "results.json").read_text())
    assert doc["benchmark"] == "demo"
    assert doc["results"] == {"qps": 12.5, "lat": [1, 2], "nan": None}
    meta = doc["meta"]
    assert meta["command"] == "qswap bench demo --quick"
    assert meta["machine"]["cores_logical"] >= 1 and meta["machine"]["cpu_model"]
    assert meta["machine"]["ram_bytes"] > 0
    assert "numpy" in meta["packages"] and meta["packages"]["numpy"] == np.__version__
    assert "commit" in meta["git"] and meta["seconds"] >= 0
    md = (out / "README.md").read_text()
    assert md.startswith("# Benchmark: demo")
    assert "`qswap bench demo --quick`" in md and "## Body" in md
    for f in ("lat.png", "bars.png", "pareto.png"):
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({f})" in md
    with pytest.raises(InvalidInputError):
        w.plot_path("x.svg")


def test_rss_of_this_process():
    import os
    assert processes.rss_bytes(os.getpid()) > 1 << 20


def test_a_benchmark_stopped_by_sigterm_stops_what_it_started(tmp_path):
    """`timeout` stops a benchmark with SIGTERM: its ``finally`` blocks run (the servers it started
    in their own sessions are stopped), where Python's default action would leave them running."""
    import os
    import signal
    import subprocess
    import sys
    import time
    script = tmp_path / "bench.py"
    script.write_text(
        "import argparse, subprocess, sys, time\n"
        "from qswap.bench.cli import stops_cleanly\n"
        "def run(args):\n"
        "    child = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
        "    try:\n"
        "        print(child.pid, flush=True)\n"
        "        time.sleep(120)\n"
        "    finally:\n"
        "        child.kill()\n"
        "        child.wait()\n"
        "stops_cleanly(run)(argparse.Namespace())\n")
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(bench.stdout.readline())   # the handshake: the child runs and the bench waits
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.05)   # polling for the kernel to reap it, not ordering events
        assert not os.path.exists(f"/proc/{child}")
    finally:
        bench.kill()
        if child is not None and os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)
