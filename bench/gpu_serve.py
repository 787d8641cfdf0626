"""The ``serve`` phase of ``qswap bench gpu``: ``POST /v1/search`` over HTTP on a real server.

``qswap serve --device cuda`` (the ``cuda`` query backend, fp16) is started as a child process
over the index the ``search`` phase built; 20 random LoRA encoders are registered; the closed-loop
load generator (:mod:`qswap.bench.loadgen`) sends searches spread over 4 and over 20 of them at
concurrency 1 and 128. Recorded per run: QPS, p50/p99, failures, the server's own breakdown
(queue, encode, search, HTTP + client) and the GPU's busy share sampled by ``nvidia-smi`` during
the run. Then, side by side on the same machine, the same server on the CPU (``--device cpu``,
the default ``shared`` backend on every core) with 4 domains: the path a team without a GPU runs.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

#: Seconds of load per measured run, and per warm-up run (the warm-up captures the buckets).
RUN_S, WARM_S = 6.0, 4.0
CONCURRENCY = (1, 128)
DOMAINS = (4, 20)


class GpuBusy:
    """The GPU's utilisation (``nvidia-smi``, every 100 ms) while the block runs; ``share`` in %."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuBusy":
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                           "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.values.append(float(line.strip().split(",")[0]))
            except ValueError:
                continue

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def share(self) -> float | None:
        return round(sum(self.values) / len(self.values), 1) if self.values else None


def _load(srv: Any, make: Any, concurrency: int, seconds: float, busy: bool) -> dict[str, Any]:
    from qswap.bench.fixtures import breakdown
    from qswap.bench.loadgen import run_load_sync

    with GpuBusy() as gpu:
        res = run_load_sync("127.0.0.1", srv.port, make, concurrency=concurrency, max_requests=10**7,
                            duration_s=seconds, timeout_s=30.0, keep_bodies=True)
    s = res.summary()
    lat = s["latency_ms"]
    out = {"qps": round(s["qps"], 1), "p50 ms": round(lat["p50"], 2), "p99 ms": round(lat["p99"], 2),
           "sent": s["sent"], "failed": s["failed"], "statuses": s["statuses"]}
    # The server's own account (response timings): HTTP + client, queue, encode, search.
    out.update({f"{k} ms": round(v, 2) for k, v in breakdown(res).items()})
    if busy:
        out["gpu busy %"] = gpu.share
    return out


def phase_serve(rec: Any, cfg: dict[str, Any], root: Path, qs: list[str]) -> None:
    """Searches over HTTP: the cuda backend (4 and 20 domains, c=1 and 128), then the CPU server.

    Args:
        rec: the phase's recorder (``qswap.bench.gpu_phases.Recorder``).
        cfg: the run's configuration.
        root: an encoders root holding LoRA encoders ``l0`` .. ``l19``.
        qs: query texts.
    """
    import torch

    from qswap.bench.fixtures import qswap_server, register, search_requests

    work = Path(cfg["work"])
    idx = work / "index"
    if not (idx / "manifest.json").exists():
        rec.put("serve", {"skipped": "needs the index the search phase builds"})
        return
    gpu = torch.cuda.is_available()
    keys = [f"l{i}@1" for i in range(20)]
    seconds, warm = (1.5, 1.0) if cfg["quick"] else (RUN_S, WARM_S)
    # Without a GPU (--cpu-trial) the cuda backend's eager twin runs in the first arm's place.
    arms = [("cuda fp16" if gpu else "cuda backend, eager twin on the CPU",
             ["--device", "cuda" if gpu else "cpu", "--backend", "cuda", "--query-precision", "fp16" if gpu else "fp32"],
             DOMAINS, gpu),
            ("cpu (shared backend, every core)", ["--device", "cpu"], (4,), False)]
    if gpu:   # the cuda worker thread waits one switch interval for the busy event loop after each sync
        arms.insert(1, ("cuda fp16, --gil-switch-ms 0.5", arms[0][1] + ["--gil-switch-ms", "0.5"], (4,), True))
    for name, extra, domains, busy in arms:
        def arm(extra: list[str] = extra, domains: tuple[int, ...] = domains, busy: bool = busy) -> dict[str, Any]:
            tag = extra[-1]
            srv = qswap_server(idx, root, work / f"state-{tag}", work / f"server-{tag}.log",
                               model=cfg["model"], extra=extra)
            out: dict[str, Any] = {"command": srv.command}
            with srv:
                out["start s"] = round(srv.start_seconds or 0.0, 1)
                out["register s"] = round(sum(register(srv, k.split("@")[0])[1] for k in keys), 2)
                for n in domains:
                    make = search_requests(qs, keys[:n])
                    for c in CONCURRENCY:   # captures the buckets each concurrency needs
                        _load(srv, make, c, warm / 2, False)
                    for c in CONCURRENCY:
                        if rec.left() < seconds + 10:
                            out[f"{n} domains c={c}"] = {"skipped": f"{rec.left():.0f} s left of the phase budget"}
                            continue
                        out[f"{n} domains c={c}"] = _load(srv, make, c, seconds, busy)
                        rec.put(name, out)
            return out
        rec.guard(name, arm, need_s=40)
