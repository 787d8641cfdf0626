"""Packaging and architecture rules: one import name, one-way dependencies."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# Dependency direction. import-linter (grimp) cannot follow a package-dir mapping that
# spreads one import name over several root folders, so the rule is checked from the source
# with ast: (importer prefix, forbidden prefix, allowed exceptions).
PACKAGES = ("qswap.encoders", "qswap.index", "qswap.tuning", "qswap.bench", "qswap.server", "qswap.cli",
            "qswap.client")
CONTRACTS = [
    ("qswap.index", "qswap.server", ()), ("qswap.encoders", "qswap.server", ()),
    ("qswap.tuning", "qswap.server", ()), ("qswap.bench", "qswap.server", ()),
    ("qswap.encoders", "qswap.index", ()), ("qswap.encoders", "qswap.tuning", ()),
    ("qswap.encoders", "qswap.bench", ()),
    ("qswap.index", "qswap.encoders", ("qswap.index.cli",)), ("qswap.index", "qswap.tuning", ()),
    ("qswap.index", "qswap.bench", ()),
    ("qswap.tuning", "qswap.bench", ()),
    ("qswap.server", "qswap.tuning", ()),
    # the guard (statistics, checks, sentinels, the evaluator) sits below both of its users
    ("qswap.guard", "qswap.server", ()), ("qswap.guard", "qswap.tuning", ()),
    ("qswap.server", "qswap.bench", ()),
    # the client talks HTTP only: it uses the core (qswap.errors) and nothing of the server side
    *[("qswap.client", pkg, ()) for pkg in ("qswap.server", "qswap.tuning", "qswap.bench", "qswap.encoders",
                                            "qswap.index")],
    # the server never calls itself through the client (tuning may: `qswap tune register`)
    ("qswap.server", "qswap.client", ()), ("qswap.index", "qswap.client", ()), ("qswap.encoders", "qswap.client", ()),
    # the CLI sits above every package: none of them imports it
    *[(pkg, "qswap.cli", ()) for pkg in PACKAGES if pkg != "qswap.cli"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path) -> set[str]:
    import ast
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def test_dependency_direction():
    """server -> index, encoders, guard; tuning -> encoders, index, guard; nothing imports server (but
    the CLI); the guard imports neither of its users."""
    mods = _modules()
    assert "qswap.server" in mods and "qswap.encoders.pool" in mods and "qswap.guard.checks" in mods
    broken = []
    for name, path in mods.items():
        for imp in _imports(name, path):
            for src, forbidden, allowed in CONTRACTS:
                if _under(name, src) and _under(imp, forbidden) and not any(
                        _under(name, a) or _under(imp, a) for a in allowed):
                    broken.append(f"{name} imports {imp}")
    assert not broken, "dependency rule broken: " + "; ".join(sorted(set(broken)))


def _core_modules(mods: dict[str, Path]) -> dict[str, Path]:
    """Modules of the shared core folder (import name ``qswap`` but none of the mapped packages)."""
    return {n: p for n, p in mods.items() if not any(_under(n, pkg) for pkg in PACKAGES)}


def test_core_imports_no_package():
    """core/ is below every package: it imports none of them, not even by name at run time
    (the CLI's dispatcher once lived there and made a folder-level loop core -> everything -> core)."""
    mods = _modules()
    core = _core_modules(mods)
    assert "qswap.space" in core and "qswap.errors" in core and "qswap.cli" not in core
    broken = []
    for name, path in core.items():
        text = path.read_text()
        for imp in _imports(name, path):
            if any(_under(imp, pkg) for pkg in PACKAGES):
                broken.append(f"{name} imports {imp}")
        if "import_module(" in text or "__import__(" in text:
            broken.append(f"{name} imports modules by name")
    assert not broken, "core rule broken: " + "; ".join(sorted(set(broken)))


def test_the_checker_sees_a_violation(tmp_path):
    """The checker itself can fail: a forbidden import in a probe file is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from qswap.server import app\nfrom . import pool\n")
    imps = _imports("qswap.encoders.probe", probe)
    assert "qswap.server" in imps and "qswap.encoders.pool" in imps


def test_every_package_folder_is_installed():
    """Each folder with __init__.py under the mapped roots is listed in pyproject packages."""
    cfg = PYPROJECT["tool"]["setuptools"]
    listed = set(cfg["packages"])
    for pkg, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([pkg, *rel.parts]) if rel.parts else pkg
            assert name in listed, f"{init.parent} is not listed in [tool.setuptools] packages"


def test_no_generic_top_level_modules(tmp_path):
    """Outside the repo, `server` etc. do not import: only `qswap.server` does."""
    code = ("import importlib.util as u, qswap.server, qswap.index, qswap.encoders, qswap.tuning;"
            "print([n for n in ('server','index','encoders','tuning','bench','core') if u.find_spec(n)])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_cli_help_lists_every_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qswap.cli", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for cmd in ("serve", "index", "encoders", "tune", "feedback", "sentinels", "demo", "bench"):
        assert cmd in r.stdout


def test_cli_help_imports_no_command_and_its_lines_are_the_commands_own(tmp_path):
    """`qswap --help` lists the commands from a table without importing their modules (torch and
    scipy take seconds); the table's help lines are exactly what each module registers."""
    code = ("import sys, contextlib, io\nfrom qswap.cli import build_parser\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    build_parser(['--help']).parse_args(['--help'])\n"
            "print(sorted(m for m in ('torch', 'scipy', 'faiss', 'numpy', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    from qswap.cli import COMMANDS, build_parser
    sub = next(a for a in build_parser([], full=True)._actions if a.dest == "command")
    registered = {a.dest: a.help for a in sub._choices_actions}
    assert registered == {name: help_text for name, (_, help_text) in COMMANDS.items()}


#: The bench library every benchmark may import; a benchmark never imports another benchmark
#: (exceptions: a benchmark's own arm kept in a second file — `bench serving --ray` in ray_serving
#: and its `--hop` layouts in ray_hop,
#: `bench serving --embeddings` in serving_embeddings,
#: `bench forward`'s adapter rows in forward_adapters and mixed batches in forward_mixed, `bench tuning --e2e` in tuning_phases and `--step` in tuning_step,
#: `bench embed`'s runtime arms in embed_arms). The Infinity peer (infinity_peer) is library:
#: `bench embed` and `bench peer` both run it; so are the int8 graphs (int8_graphs) of `bench embed`,
#: `bench forward` and `bench bf16-quality`.
BENCH_LIBRARY = ("provenance", "stats", "results", "plots", "processes", "load_options", "fixtures", "loadgen",
                 "data", "infinity_peer", "tiny_model", "milvus_server", "int8_graphs",
                 "settle", "revisions")
BENCH_ALLOWED = {("qswap.bench.serving", "qswap.bench.ray_serving"),
                 ("qswap.bench.serving", "qswap.bench.ray_hop"), ("qswap.bench.ray_hop", "qswap.bench.ray_serving"),
                 ("qswap.bench.serving", "qswap.bench.serving_embeddings"),
                 ("qswap.bench.forward", "qswap.bench.forward_adapters"),
                 ("qswap.bench.forward", "qswap.bench.forward_mixed"),   # `bench forward --mixed-only`
                 ("qswap.bench.tuning_speed", "qswap.bench.tuning_phases"),
                 ("qswap.bench.tuning_speed", "qswap.bench.tuning_step"),   # modes of `qswap bench tuning`
                 ("qswap.bench.ray_embed", "qswap.bench.embed_arms"),
                 ("qswap.bench.gpu_phases", "qswap.bench.gpu_serve"),   # the `serve` phase of `bench gpu`
                 # `bench index --backend LIST` in index_backends, its `--http` arm in index_http
                 ("qswap.bench.index_bench", "qswap.bench.index_backends"),
                 ("qswap.bench.index_backends", "qswap.bench.index_http"),
                 # `bench domains`: its data, its power analysis and its report in files of their own
                 ("qswap.bench.domains", "qswap.bench.domains_data"), ("qswap.bench.domains", "qswap.bench.domains_power"),
                 ("qswap.bench.domains", "qswap.bench.domains_report"),
                 ("qswap.bench.domains_report", "qswap.bench.domains_data"),
                 ("qswap.bench.domains_power", "qswap.bench.domains_data"),
                 ("qswap.bench.domains_power", "qswap.bench.loop")}   # the simulated user of `bench loop`


def test_benchmarks_import_the_library_not_each_other():
    mods = _modules()
    benches = {n for n in mods if _under(n, "qswap.bench") and n != "qswap.bench"
               and not any(_under(n, f"qswap.bench.{lib}") for lib in BENCH_LIBRARY) and n != "qswap.bench.cli"}
    assert "qswap.bench.serving" in benches and "qswap.bench.fixtures" not in benches
    broken = []
    for name in benches:
        for imp in _imports(name, mods[name]):
            target = next((b for b in benches if imp == b or imp.startswith(b + ".")), None)
            if target and target != name and (name, target) not in BENCH_ALLOWED:
                broken.append(f"{name} imports {target}")
    assert not broken, "benchmarks import each other: " + "; ".join(sorted(set(broken)))


#: Optional frameworks: only their integration modules import them (extras qswap[langchain], ...).
FRAMEWORKS = {"langchain_core": "qswap.client.langchain", "llama_index": "qswap.client.llamaindex",
              "openai": None, "langchain_openai": None}


def test_frameworks_are_imported_only_by_their_integration(tmp_path):
    mods = _modules()
    broken = [f"{name} imports {imp}" for name, path in mods.items() for imp in _imports(name, path)
              for fw, owner in FRAMEWORKS.items() if _under(imp, fw) and name != owner]
    assert not broken, "framework imported outside its integration: " + "; ".join(sorted(set(broken)))
    code = ("import sys, qswap.client, qswap.server.http.app;"
            "print([m for m in sys.modules if m.split('.')[0] in ('langchain_core', 'llama_index', 'openai')])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def _file_edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules (files) ``name`` imports, function-level imports included: ``from a import b``
    is an edge to ``a.b`` where that is a module, else to ``a`` (``b`` is a name in it)."""
    import ast
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    out.add(sub)
                elif base in mods:
                    out.add(base)
    out.discard(name)
    return out


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


#: Circles known and being removed elsewhere (each with its reason); the test fails on any other.
KNOWN_CIRCLES: list[list[str]] = []


def test_no_import_circle_between_files():
    """No two files import each other, directly or around a loop (imports inside functions count:
    a lazy import still ties the two files together)."""
    mods = _modules()
    edges = {n: _file_edges(n, p, mods) for n, p in mods.items()}
    assert "qswap.encoders.runtime.protocol" in edges["qswap.encoders.runtime.backend"]
    circles = [c for c in _circles(edges) if c not in KNOWN_CIRCLES]
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_sees_a_circle():
    """The finder itself can fail: a loop of three and a self-free chain."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_wheel_ships_the_package_not_the_benchmark_results(tmp_path):
    """bench/results/ (figures, scripts, data paths of the machines they ran on) stays in the
    repository: a wheel built from the tree holds the code and its package data, none of it."""
    import shutil
    import zipfile
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
    assert any((tree / "bench" / "results").rglob("*.json"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "out"), str(tree)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    names = zipfile.ZipFile(next((tmp_path / "out").glob("qswap-*.whl"))).namelist()
    assert "qswap/server/openapi.json" in names and "qswap/bench/results.py" in names
    assert not [n for n in names if n.startswith("qswap/bench/results/")]
