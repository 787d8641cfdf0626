"""What every benchmark shares: provenance, statistics, side-by-side runs, result files, plots.

A result directory ``bench/results/<name>/`` holds:

- ``results.json``: ``{"benchmark", "meta": {...}, "results": {...}}`` where ``meta`` is the
  git commit (and whether the tree had uncommitted changes), the machine (CPU model,
  cores, RAM, OS), package versions, the exact command line and start/end times;
- ``README.md``: the same provenance as a header, then the benchmark's own markdown;
- ``*.png``: plots (matplotlib, Agg backend).

Comparisons are measured side by side: :func:`interleaved` runs the arms alternately
(ABAB..., order flipped every round so neither arm always goes first) and
:func:`ratio_summary` reports per-round ratios as a median with their spread, so slow
drift of a shared machine hits both arms alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from qswap.atomic import atomic_write_bytes, atomic_write_json
from qswap.errors import InvalidInputError

if TYPE_CHECKING:
    from qswap.bench.loadgen import LoadResult, Request

#: Packages whose versions every result records (missing ones are recorded as null).
DEFAULT_PACKAGES = ("qswap", "torch", "transformers", "tokenizers", "peft", "faiss-cpu", "numpy",
                    "fastapi", "uvicorn", "sentence-transformers", "onnxruntime")
RESULTS_FILE = "results.json"
SUMMARY_FILE = "README.md"
_REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- provenance


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, logical cores (and those this process may use), RAM, OS, Python."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    ram = _ram_bytes()
    try:
        import torch
        torch_threads: int | None = torch.get_num_threads()
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        torch_threads, gpu = None, None
    return {
        "cpu_model": _cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_usable": usable,
        "ram_bytes": ram,
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch_threads": torch_threads,
        "gpu": gpu,
        # Other work on the machine shows here: a load above the core count means sharing.
        "loadavg": _loadavg(),
    }


def git_info(repo: Path = _REPO) -> dict[str, Any]:
    """The commit of ``repo`` and whether its tree differs from it (``dirty``); nulls outside git."""
    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def package_versions(names: Sequence[str] = DEFAULT_PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions (``None`` where not installed)."""
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as a user would type it: ``qswap bench ...`` when run through the qswap script."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    head = Path(argv[0]).name
    if head in ("qswap", "cli.py", "__main__.py") or argv[0].endswith("qswap/cli.py"):
        return shlex.join(["qswap", *argv[1:]])
    return shlex.join(argv)


def run_meta(argv: Sequence[str] | None = None, packages: Sequence[str] = DEFAULT_PACKAGES) -> dict[str, Any]:
    """Everything needed to say where a number came from."""
    return {"git": git_info(), "machine": machine_info(), "packages": package_versions(packages),
            "command": command_line(argv), "argv": list(sys.argv if argv is None else argv)}


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    Same definition as ``numpy.percentile``'s default (Hyndman & Fan type 7): the value at
    rank ``(n - 1) * q / 100`` of the sorted sample. NaN for an empty sample.
    """
    if not 0 <= q <= 100:
        raise InvalidInputError(f"percentile {q} is outside 0..100", "use e.g. 50, 95, 99")
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    rank = (len(xs) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """``n``, ``mean``, ``min``, ``max`` and ``p<q>`` for each ``q`` of a sample."""
    xs = [float(v) for v in values]
    out: dict[str, float] = {"n": len(xs)}
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    out["min"] = min(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    for q in qs:
        out[f"p{q:g}"] = percentile(xs, q)
    return out


@dataclass
class RatioSummary:
    """Per-round ratios ``a / b``: their median, quartiles and range."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    n: int
    ratios: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "min": self.min,
                "max": self.max, "n": self.n, "ratios": self.ratios}

    def __str__(self) -> str:
        return f"{self.median:.2f}x (IQR {self.p25:.2f}-{self.p75:.2f}, n={self.n})"


def ratio_summary(a: Sequence[float], b: Sequence[float]) -> RatioSummary:
    """Summarise paired rounds: ratio of ``a[i] / b[i]`` per round (pairs with b == 0 dropped)."""
    if len(a) != len(b):
        raise InvalidInputError(f"{len(a)} rounds of A but {len(b)} of B", "pair every round")
    rs = [float(x) / float(y) for x, y in zip(a, b) if y]
    if not rs:
        return RatioSummary(math.nan, math.nan, math.nan, math.nan, math.nan, 0, [])
    return RatioSummary(percentile(rs, 50), percentile(rs, 25), percentile(rs, 75), min(rs), max(rs),
                        len(rs), rs)


def interleaved(arms: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 1,
                on_round: Callable[[int, str, Any], None] | None = None) -> dict[str, list[Any]]:
    """Run each arm once per round, alternating, and collect their results per arm.

    Round ``r`` runs the arms in the given order when ``r`` is even and reversed when odd
    (A B, B A, A B, ...), so neither always runs first (caches, thermal state, a
    neighbour's load). ``warmup`` rounds run the same way but are discarded.
    """
    if rounds < 1:
        raise InvalidInputError(f"rounds must be >= 1, got {rounds}", "use at least 3 for a spread")
    names = list(arms)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            value = arms[n]()
            if r >= warmup:
                out[n].append(value)
                if on_round is not None:
                    on_round(r - warmup, n, value)
    return out


# --------------------------------------------------------------------------- results


def default_results_dir(name: str) -> Path:
    """``bench/results/<name>`` in the source tree (or under the working directory when installed)."""
    root = _REPO if (_REPO / "bench" / "harness.py").exists() else Path.cwd()
    return root / "bench" / "results" / name


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats shown with up to 3 significant decimals."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "n/a"
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _busy_note(meta: Mapping[str, Any]) -> str:
    cores = meta.get("machine", {}).get("cores_logical") or 1
    loads = [x for key in ("loadavg",) for x in (meta.get("machine", {}).get(key) or [])[:1]]
    loads += (meta.get("loadavg_end") or [])[:1]
    # Load counts runnable threads: a benchmark's own servers can exceed the cores too, so the
    # note says the CPU was oversubscribed without claiming by whom.
    if loads and max(loads) > cores + 1:
        return (f" (above {cores} cores + 1: the CPU was oversubscribed, by this benchmark's own "
                "threads or by other processes)")
    return ""


def _meta_markdown(name: str, meta: Mapping[str, Any]) -> str:
    m = meta.get("machine", {})
    g = meta.get("git", {})
    pk = meta.get("packages", {})
    commit = (g.get("commit") or "unknown")[:12] + (" (uncommitted changes)" if g.get("dirty") else "")
    pkgs = ", ".join(f"{k} {v}" for k, v in pk.items() if v)
    return (f"# Benchmark: {name}\n\n"
            f"- command: `{meta.get('command', '')}`\n"
            f"- commit: {commit}\n"
            f"- machine: {m.get('cpu_model')}, {m.get('cores_usable')} usable / {m.get('cores_logical')} "
            f"logical cores, {m.get('ram_gib')} GiB RAM, {m.get('os')}, Python {m.get('python')}\n"
            f"- packages: {pkgs}\n"
            f"- started: {meta.get('started')}, took {meta.get('seconds', 0):.0f} s; load average (1/5/15 min) "
            f"{m.get('loadavg')} at start, {meta.get('loadavg_end')} at end{_busy_note(meta)}\n\n")


def to_json(o: Any) -> Any:
    """Plain JSON data from results: numpy scalars/arrays, Paths, ``to_dict()`` objects; NaN/inf -> null."""
    if isinstance(o, Mapping):
        return {str(k): to_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set)):
        return [to_json(v) for v in o]
    if isinstance(o, bool) or o is None or isinstance(o, (int, str)):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if hasattr(o, "to_dict"):
        return to_json(o.to_dict())
    if hasattr(o, "tolist"):      # numpy arrays and scalars
        return to_json(o.tolist())
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class ResultWriter:
    """Collects a benchmark's provenance at start and writes its result files at the end.

    >>> w = ResultWriter("serving", out_dir)      # meta captured now (commit, machine, ...)
    >>> w.plot_path("latency.png")                # where a plot goes
    >>> w.write(results_dict, markdown_body)      # results.json + README.md, atomically
    """

    def __init__(self, name: str, out_dir: Path | None = None, argv: Sequence[str] | None = None,
                 packages: Sequence[str] = DEFAULT_PACKAGES) -> None:
        self.name = name
        self.out_dir = Path(out_dir) if out_dir is not None else default_results_dir(name)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.meta = run_meta(argv, packages)
        self.meta["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._t0 = time.perf_counter()
        self.plots: list[str] = []

    def plot_path(self, filename: str) -> Path:
        """Path of a plot file in the result directory (recorded for the summary)."""
        if not filename.endswith(".png"):
            raise InvalidInputError(f"plot {filename!r} is not a .png", "plots are PNG files")
        self.plots.append(filename)
        return self.out_dir / filename

    def write(self, results: Mapping[str, Any], markdown: str) -> Path:
        """Write ``results.json`` and ``README.md`` (provenance header + ``markdown`` + plots)."""
        self.meta["seconds"] = round(time.perf_counter() - self._t0, 2)
        self.meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.meta["loadavg_end"] = _loadavg()
        doc = {"benchmark": self.name, "meta": self.meta, "results": results}
        atomic_write_json(self.out_dir / RESULTS_FILE, to_json(doc))
        body = _meta_markdown(self.name, self.meta) + markdown.rstrip() + "\n"
        if self.plots:
            body += "\n" + "\n".join(f"![{Path(p).stem}]({p})" for p in dict.fromkeys(self.plots)) + "\n"
        atomic_write_bytes(self.out_dir / SUMMARY_FILE, body.encode("utf-8"))
        return self.out_dir


# --------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_lines(path: Path, x: Sequence[float], series: Mapping[str, Sequence[float]], *, xlabel: str,
               ylabel: str, title: str, logx: bool = False, logy: bool = False,
               bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
               vlines: Sequence[float] = (), vlabel: str = "") -> Path:
    """Line plot of several series over one x axis; optional shaded (low, high) band per series
    and dotted vertical markers (``vlines``, e.g. when events happened)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        (line,) = ax.plot(list(x), list(ys), marker="o", label=name)
        if bands and name in bands:
            lo, hi = bands[name]
            ax.fill_between(list(x), list(lo), list(hi), color=line.get_color(), alpha=0.15)
    for i, v in enumerate(vlines):
        ax.axvline(v, color="grey", linestyle=":", linewidth=1, label=vlabel if i == 0 and vlabel else None)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_bars(path: Path, labels: Sequence[str], series: Mapping[str, Sequence[float]], *, ylabel: str,
              title: str, stacked: bool = False) -> Path:
    """Grouped (or stacked) bars: one group per label, one bar per series."""
    plt = _pyplot()
    import numpy as np
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) + 3), 4.5))
    xs = np.arange(len(labels))
    k = max(len(series), 1)
    width = 0.8 if stacked else 0.8 / k
    bottom = np.zeros(len(labels))
    for i, (name, ys) in enumerate(series.items()):
        ys_a = np.asarray(ys, dtype=float)
        if stacked:
            ax.bar(xs, ys_a, width, bottom=bottom, label=name)
            bottom += ys_a
        else:
            ax.bar(xs - 0.4 + width * (i + 0.5), ys_a, width, label=name)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=20 if max(map(len, labels), default=0) > 8 else 0, ha="right"
                       if max(map(len, labels), default=0) > 8 else "center")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats: lower cost (x) and higher value (y).

    The "operating points" of FAISS's contrib module: sorted by cost, a point is kept when
    its value exceeds every cheaper point's value.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    best = -math.inf
    front = []
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def plot_pareto(path: Path, points: Sequence[tuple[float, float]], labels: Sequence[str], *, xlabel: str,
                ylabel: str, title: str, logx: bool = True) -> Path:
    """Scatter of (cost, value) with the Pareto front drawn and its points labelled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=18, alpha=0.5, color="grey")
    front = pareto_front(points)
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-o", color="C3", label="Pareto front")
    for i in front:
        ax.annotate(labels[i], points[i], fontsize=7, xytext=(4, -8), textcoords="offset points")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError as e:
        raise InvalidInputError(f"cannot read memory of process {pid}: {e}", "is it still running?") from e
    raise InvalidInputError(f"process {pid} reports no VmRSS", "Linux /proc is needed for memory numbers")


def pss_bytes(pid: int) -> int | None:
    """Proportional set size (shared pages split between sharers), or None where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- servers under test


def results_dir_for(name: str, quick: bool, out: Path | None) -> Path:
    """Where a run writes: ``out`` if given, else ``bench/results/<name>`` (``.../tmp/quick`` for --quick).

    Quick runs land under the git-ignored ``tmp/`` so a smoke run never replaces the
    committed results of a full run.
    """
    if out is not None:
        return Path(out)
    d = default_results_dir(name)
    return d / "tmp" / "quick" if quick else d


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (bound and released; tiny race accepted for benchmarks)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0,
              headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
    """One JSON request with the standard library (admin calls; not for load): ``(status, json)``."""
    import urllib.error
    import urllib.request
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode("utf-8", "replace")


class ServerProcess:
    """A server under test, run as a child process (its own session) and stopped at exit.

    >>> with ServerProcess(cmd, port, ready_path="/ready", log_path=p) as srv:
    ...     srv.url("/v1/search"), srv.rss()
    """

    def __init__(self, cmd: Sequence[str], port: int, *, ready_path: str = "/health",
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 300.0, cwd: Path | None = None) -> None:
        self.cmd = [str(c) for c in cmd]
        self.port = port
        self.ready_path = ready_path
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        self._log = None

    @property
    def command(self) -> str:
        return shlex.join(self.cmd)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> "ServerProcess":
        """Start the process and wait until ``ready_path`` answers 200 (raises if it dies first)."""
        import urllib.error
        import urllib.request
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                raise InvalidInputError(f"server exited with status {self.proc.returncode} during start: "
                                        f"{self.command}\n{tail}", "see the server log above")
            try:
                with urllib.request.urlopen(self.url(self.ready_path), timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.perf_counter() - t0 > self.start_timeout_s:
                self.stop()
                raise InvalidInputError(f"server not ready after {self.start_timeout_s:.0f} s: {self.command}",
                                        "see its log: " + str(self.log_path))
            time.sleep(0.2)
        self.start_seconds = time.perf_counter() - t0
        return self

    def log_tail(self, n: int = 30) -> str:
        if self.log_path and Path(self.log_path).exists():
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        return ""

    def rss(self) -> int:
        assert self.proc is not None
        return rss_bytes(self.proc.pid)

    def pss(self) -> int | None:
        assert self.proc is not None
        return pss_bytes(self.proc.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; only this process (and its own group)."""
        import signal
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- load-test options

#: Where load tests send their traffic: servers under test listen on loopback only.
LOAD_HOST = "127.0.0.1"
MODEL_HELP = "base model (bundled name or directory)"

T = TypeVar("T")


def _show(value: Any) -> str:
    """A default as help text shows it: ``8.0`` -> ``8``, ``(1, 4)`` -> ``1,4``."""
    if isinstance(value, (tuple, list)):
        return ",".join(_show(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class ByMode(Generic[T]):
    """A default that differs between a full run and a ``--quick`` smoke run."""

    full: T
    quick: T

    def pick(self, quick: bool) -> T:
        """The default for this mode."""
        return self.quick if quick else self.full

    def describe(self) -> str:
        """``"default 8; quick 2"``, for help texts."""
        return f"default {_show(self.full)}; quick {_show(self.quick)}"


@dataclass(frozen=True)
class LoadDefaults:
    """One command's defaults for the shared load options (see :func:`add_load_arguments`).

    ``rounds_help`` names what a round is for that command ("A/B rounds per level", ...).
    """

    levels: ByMode[tuple[int, ...]]
    seconds: ByMode[float]
    requests: ByMode[int]
    rounds: ByMode[int]
    rounds_help: str = "rounds per level"


def parse_levels(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``: the argparse type of ``--concurrency`` levels."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None


def add_load_arguments(parser: argparse.ArgumentParser, defaults: LoadDefaults) -> None:
    """Add ``--concurrency`` (levels), ``--seconds``, ``--requests`` and ``--rounds``.

    Every flag defaults to ``None``; :meth:`LoadOptions.from_args` fills in the command's
    ``defaults`` for the mode (full or ``--quick``), which the help texts quote.
    """
    parser.add_argument("--concurrency", type=parse_levels, default=None,
                        help=f"comma-separated levels ({defaults.levels.describe()})")
    parser.add_argument("--seconds", type=float, default=None, help=f"per run ({defaults.seconds.describe()})")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"at most per run ({defaults.requests.describe()})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"{defaults.rounds_help} ({defaults.rounds.describe()})")


def add_model_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """Add ``--model``: the base model the server under test loads."""
    parser.add_argument("--model", default=default, help=MODEL_HELP)


@dataclass(frozen=True)
class LoadOptions:
    """The load options of one run: the flags given, else the command's defaults for its mode."""

    quick: bool
    levels: list[int]
    seconds: float
    requests: int
    rounds: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, defaults: LoadDefaults) -> "LoadOptions":
        """Resolve the flags of :func:`add_load_arguments` (and ``--quick``) against ``defaults``."""
        quick = bool(getattr(args, "quick", False))
        # ``or``, not ``is None``: a 0 also means "the default", as these commands always had it.
        return cls(quick=quick,
                   levels=list(args.concurrency or defaults.levels.pick(quick)),
                   seconds=args.seconds or defaults.seconds.pick(quick),
                   requests=args.requests or defaults.requests.pick(quick),
                   rounds=args.rounds or defaults.rounds.pick(quick))

    def run(self, port: int, make_request: "Callable[[int], Request] | Sequence[Request]", concurrency: int,
            **kwargs: Any) -> "LoadResult":
        """One measured run on ``LOAD_HOST:port``: at most ``requests`` requests or ``seconds``.

        ``kwargs`` go to :func:`qswap.bench.loadgen.run_load` (``keep_bodies``, ...).
        """
        from qswap.bench.loadgen import run_load_sync
        return run_load_sync(LOAD_HOST, port, make_request, concurrency=concurrency,
                             max_requests=self.requests, duration_s=self.seconds, **kwargs)


def warm_up(port: int, make_request: "Callable[[int], Request] | Sequence[Request]", *, concurrency: int = 4,
            requests: int = 64, duration_s: float = 30.0) -> "LoadResult":
    """Unmeasured load before timing (adapters loaded, code paths run); the result is for checks only."""
    from qswap.bench.loadgen import run_load_sync
    return run_load_sync(LOAD_HOST, port, make_request, concurrency=concurrency, max_requests=requests,
                         duration_s=duration_s)


@dataclass
class RunDirs:
    """Where one run writes: its result directory, :class:`ResultWriter`, and a scratch ``tmp/``.

    ``tmp/`` holds what servers under test need (state directory, logs). It is kept after a
    ``--quick`` run, to read the logs, and removed after a full one.
    """

    name: str
    quick: bool
    out: Path
    tmp: Path
    writer: ResultWriter

    @classmethod
    def create(cls, name: str, quick: bool, out: Path | None) -> "RunDirs":
        """Resolve the result directory (:func:`results_dir_for`), start its writer, make ``tmp/``."""
        d = results_dir_for(name, quick, out)
        writer = ResultWriter(name, d)
        tmp = d / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return cls(name, quick, d, tmp, writer)

    def clean_scratch(self) -> None:
        """Remove ``tmp/`` after a full run (kept after ``--quick``)."""
        if not self.quick:
            shutil.rmtree(self.tmp, ignore_errors=True)
