"""bench/gpu_device: the scripts parse, and the wheel selection installs only what a machine lacks."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "bench" / "gpu_device"


def test_scripts_parse():
    for script in ("prepare.sh", "run.sh"):
        r = subprocess.run(["bash", "-n", str(DEVICE / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_wheels_are_selected_by_what_is_installed(tmp_path):
    spec = importlib.util.spec_from_file_location("select_wheels", DEVICE / "select_wheels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = ["qswap-0.1.0-py3-none-any.whl",              # always: the code under test
             "numpy-0.1-cp312-cp312-any.whl",             # installed here, newer: not carried over it
             "numpy_never_installed_dist-1.0-py3-none-any.whl",   # missing: installed
             "pydantic_core-999.0-cp312-cp312-any.whl",   # newer than here: installed, and with it pydantic
             "pydantic-0.1-py3-none-any.whl"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    got = sorted(p.name for p in mod.select(tmp_path))
    assert got == sorted([names[0], names[2], names[3], names[4]])
