"""``qswap tune`` / ``qswap sentinels`` options come from :mod:`qswap.tuning.choices`: building them
(``--help``, or a command that trains nothing) imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["tune", "run", "--help"], ["sentinels", "make", "--help"]])
def test_tuning_help_needs_no_torch(argv, tmp_path):
    code = ("import sys, contextlib, io\nfrom qswap.cli import build_parser\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
            f"    build_parser({argv!r}).parse_args({argv!r})\n"
            "assert '--help' in out.getvalue() or 'usage' in out.getvalue()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
