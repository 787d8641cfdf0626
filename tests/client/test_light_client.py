"""The light distribution ``qswap-client`` (client/pyproject.toml): built from this checkout,
installed from its wheel into a fresh virtual environment (httpx and pydantic come from the
package index or pip's cache), and run there against a real server of the full venv.

What the docs claim about the two distributions is checked here: the wheel holds the same files
the full ``qswap`` installs under the same names, byte for byte, at the same version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

import qswap

from ..server.conftest import ADMIN

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    shutil.rmtree(REPO / "build" / "qswap-client", ignore_errors=True)   # setuptools would pack stale files
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(out), "."], cwd=REPO / "client", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("qswap_client-*.whl")
    return whl


def _source(name: str) -> Path:
    """The checkout file the full qswap installs as ``name`` (pyproject's package-dir)."""
    return REPO / ("client/" + name.removeprefix("qswap/client/") if name.startswith("qswap/client/")
                   else "core/" + name.removeprefix("qswap/"))


def test_the_wheel_is_the_same_modules_at_the_same_version(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("qswap/")]
        assert {"qswap/client/__init__.py", "qswap/errors.py", "qswap/answers.py", "qswap/py.typed",
                "qswap/client/py.typed"} <= set(names)
        assert not [n for n in names if n.count("/") > 1 and not n.startswith("qswap/client/")
                    and n.rsplit("/", 1)[-1] not in ("__init__.py", "status.py", "record.py", "experiment.py")]
        for n in names:
            assert z.read(n) == _source(n).read_bytes(), n
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert f"Version: {qswap.__version__}\n" in meta
    light = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
    full = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert light["version"] == full["version"] == qswap.__version__
    deps = {d.split(">")[0].split("=")[0] for d in light["dependencies"]}
    assert deps == {"httpx", "pydantic"}


def test_installed_alone_it_works_without_torch_or_numpy(wheel, live, tmp_path):
    env_dir = tmp_path / "venv"
    # No pip of its own (ensurepip costs ~5 s): this venv's pip installs into it (`pip --python`).
    venv.create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([str(py), str(Path(__file__).with_name("light_smoke.py")), live.url, ADMIN],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "light client ok"
