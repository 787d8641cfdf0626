"""Print the carried wheels this interpreter needs: a distribution it lacks or has older (qswap
always); pydantic and pydantic-core together (they pin each other). Run by ``run.sh``."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path


def _version(s: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", s))


def select(folder: Path) -> list[Path]:
    wheels = sorted(folder.glob("*.whl"))
    chosen = set()
    for w in wheels:
        dist, ver = w.name.split("-")[:2]
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            have = None
        if dist == "qswap" or have is None or _version(have) < _version(ver):
            chosen.add(w)
    pair = [w for w in wheels if w.name.split("-")[0] in ("pydantic", "pydantic_core")]
    if any(w in chosen for w in pair):
        chosen.update(pair)
    return [w for w in wheels if w in chosen]


if __name__ == "__main__":
    print(" ".join(str(w) for w in select(Path(sys.argv[1]))))
