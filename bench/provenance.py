"""Where a benchmark result comes from: git commit, machine, package versions, command line."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

#: Packages whose versions every result records (missing ones are recorded as null).
DEFAULT_PACKAGES = ("qswap", "torch", "transformers", "tokenizers", "peft", "faiss-cpu", "numpy",
                    "fastapi", "uvicorn", "sentence-transformers", "onnxruntime")
REPO = Path(__file__).resolve().parents[1]


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


def loadavg() -> list[float] | None:
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
        "loadavg": loadavg(),
    }


def git_info(repo: Path = REPO) -> dict[str, Any]:
    """The commit of ``repo`` and whether its tree differs from it (``dirty``); nulls outside git."""
    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None and os.environ.get("QSWAP_COMMIT"):
        # An installed wheel on a machine without the checkout (the GPU payload): the commit the
        # wheel was built from, as its preparer recorded it.
        return {"commit": os.environ["QSWAP_COMMIT"], "dirty": None}
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
