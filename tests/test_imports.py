"""Every ``from qswap.X import Y`` in the source tree names something that exists, including imports
inside functions, which run only when their code path does (a moved function would otherwise
surface as an ImportError in the middle of a benchmark or a rarely used command)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "server", "index", "encoders", "tuning", "bench", "cli", "client")


def _imports() -> list[tuple[str, int, str, str]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).parts   # a checkout may itself live under /tmp
            if "tmp" in rel or "results" in rel:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qswap") \
                        and node.level == 0:
                    for alias in node.names:
                        out.append((str(path.relative_to(ROOT)), node.lineno, node.module, alias.name))
    return out


IMPORTS = _imports()


def test_the_tree_has_function_level_imports_to_check():
    assert len(IMPORTS) > 200


@pytest.mark.parametrize("module", sorted({m for _, _, m, _ in IMPORTS}))
def test_every_imported_name_exists(module: str):
    mod = importlib.import_module(module)
    missing = [f"{f}:{line} imports {n} from {module}" for f, line, m, n in IMPORTS
               if m == module and n != "*" and not hasattr(mod, n)
               and importlib.util.find_spec(f"{module}.{n}") is None]
    assert not missing, "\n".join(missing)
