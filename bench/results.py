"""Result directories. ``bench/results/<name>/`` holds:

- ``results.json``: ``{"benchmark", "meta": {...}, "results": {...}}`` where ``meta`` is the
  git commit (and whether the tree had uncommitted changes), the machine (CPU model,
  cores, RAM, OS), package versions, the exact command line and start/end times;
- ``README.md``: the same provenance as a header, then the benchmark's own markdown;
- ``*.png``: plots (:mod:`qswap.bench.plots`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qswap.atomic import atomic_write_bytes, atomic_write_json
from qswap.bench.provenance import DEFAULT_PACKAGES, REPO, loadavg, run_meta
from qswap.errors import InvalidInputError

RESULTS_FILE = "results.json"
SUMMARY_FILE = "README.md"


def default_results_dir(name: str) -> Path:
    """``bench/results/<name>`` in the source tree (or under the working directory when installed)."""
    root = REPO if (REPO / "bench" / "results.py").exists() else Path.cwd()
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
        self.meta["loadavg_end"] = loadavg()
        doc = {"benchmark": self.name, "meta": self.meta, "results": results}
        atomic_write_json(self.out_dir / RESULTS_FILE, to_json(doc))
        body = _meta_markdown(self.name, self.meta) + markdown.rstrip() + "\n"
        if self.plots:
            body += "\n" + "\n".join(f"![{Path(p).stem}]({p})" for p in dict.fromkeys(self.plots)) + "\n"
        atomic_write_bytes(self.out_dir / SUMMARY_FILE, body.encode("utf-8"))
        return self.out_dir

def results_dir_for(name: str, quick: bool, out: Path | None) -> Path:
    """Where a run writes: ``out`` if given, else ``bench/results/<name>`` (``.../tmp/quick`` for --quick).

    Quick runs land under the git-ignored ``tmp/`` so a smoke run never replaces the
    committed results of a full run.
    """
    if out is not None:
        return Path(out)
    d = default_results_dir(name)
    return d / "tmp" / "quick" if quick else d
