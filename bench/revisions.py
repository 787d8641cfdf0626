"""Code versions side by side: ``--arm LABEL=REV`` options resolved to commands that run that revision.

A revision is checked out of git into a folder laid out as the installed package (the
``package-dir`` mapping of its ``pyproject.toml``) and run with that folder first on
``PYTHONPATH``, under the same interpreter and packages as this one; ``.`` is the installed
working tree itself.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from qswap.bench.fixtures import qswap_command
from qswap.bench.provenance import REPO
from qswap.errors import InvalidInputError

# ``qswap`` of a checked-out revision: its own cli module, not the installed console script's.
_REVISION_MAIN = "import sys; from qswap.cli import main; sys.exit(main())"


def checkout(rev: str, into: Path) -> Path:
    """Revision ``rev`` of this repository as an importable ``qswap`` tree under ``into``."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=False)
    if tar.returncode != 0:
        raise InvalidInputError(f"git archive {rev} failed: {tar.stderr.decode()[-500:]}", "give a git revision")
    src = into / "src"
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(src, filter="data")
    tree = into / "tree"
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for pkg, folder in mapping.items():   # "qswap" (core/) first, then its subpackages into it
        shutil.copytree(src / folder, tree.joinpath(*pkg.split(".")), dirs_exist_ok=True)
    return tree


def parse_arms(values: list[str] | None, default: str = "this=.") -> list[tuple[str, str]]:
    """``LABEL=REV`` options as ``(label, revision)``, each revision resolved to its short commit
    (so that results say what ran); ``.`` stays ``.``.

    Raises:
        InvalidInputError: an option is not ``LABEL=REV``, or names no revision of this repository.
    """
    arms: list[tuple[str, str]] = []
    for a in values or [default]:
        label, sep, rev = a.partition("=")
        if not sep or not label or not rev:
            raise InvalidInputError(f"--arm {a!r} is not LABEL=REV", "e.g. --arm before=main --arm after=.")
        if rev != ".":
            got = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", rev], capture_output=True, text=True)
            if got.returncode != 0:
                raise InvalidInputError(f"--arm {a!r}: {got.stderr.strip()}", "give a git revision")
            rev = got.stdout.strip()
        arms.append((label, rev))
    return arms


def arm_command(label: str, rev: str, work: Path) -> tuple[list[str], dict[str, str]]:
    """The ``qswap`` command line and extra environment that run revision ``rev`` (checked out
    under ``work/label`` unless it is ``.``)."""
    if rev == ".":
        return qswap_command(), {}
    return [sys.executable, "-c", _REVISION_MAIN], {"PYTHONPATH": str(checkout(rev, work / label))}
