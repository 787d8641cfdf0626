"""The documentation site builds with ``mkdocs build --strict``, and its generated pages match their sources.

Strict mode turns every warning into a failure: a link to a missing page or anchor, a page missing
from the site, a mkdocstrings reference that cannot be collected.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .snippets import REPO

def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def _text(site: Path, page: str) -> str:
    return re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = _build(REPO / "mkdocs.yml", out)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    return out


def test_settings_table_is_generated_from_server_settings(site: Path) -> None:
    from qswap.server.config import ServerSettings

    text = _text(site, "operations")
    for name, field in ServerSettings.model_fields.items():
        assert f"QSWAP_{name.upper()}" in text, f"{name} is missing from the settings table"
        if field.description:
            assert field.description.split(";")[0][:30] in text.replace("&#39;", "'")


def test_http_api_is_generated_from_the_committed_openapi(site: Path) -> None:
    spec = json.loads((REPO / "server" / "openapi.json").read_text())
    text = _text(site, "http-api")
    for path, item in spec["paths"].items():
        for method in item:
            assert f"{method.upper()} {path}" in text, f"{method.upper()} {path} is missing"
    for schema in spec["components"]["schemas"]:
        assert schema in text


def test_benchmarks_page_shows_every_results_file_with_its_provenance(site: Path) -> None:
    text = _text(site, "benchmarks")
    results = REPO / "bench" / "results"
    files = sorted(p for p in results.rglob("results.json") if "tmp" not in p.relative_to(results).parts)
    assert len(files) > 10
    for f in files:
        meta = json.loads(f.read_text())["meta"]
        assert meta["command"] and meta["git"]["commit"] and meta["machine"]["cpu_model"], f"{f}: provenance"
        assert meta["git"]["commit"][:12] in text, f"{f}: its commit is not on the summary"
        name = f.parent.relative_to(results).as_posix()
        page = _text(site, f"benchmark/{name}/results")            # one click away: its own page
        assert meta["command"][:40].replace("<", " ") in page or meta["git"]["commit"][:12] in page, name
    for png in (REPO / "bench" / "results").rglob("*.png"):
        rel = png.relative_to(REPO / "bench" / "results")
        if "tmp" not in rel.parts and (png.parent / "results.json").exists():
            assert (site / "bench" / rel).is_file(), f"plot {rel} is not in the site"


def test_benchmarks_summary_reads_every_headline_from_its_results() -> None:
    """Each figure bench/results/headlines.toml declares is read from its results file (a benchmark
    whose output changed shape fails here, not silently on the page), with a verdict where a target is set."""
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(REPO / "docs"))
    results = REPO / "bench" / "results"
    heads = hooks.headlines(results)
    assert heads, "no headline figures declared"
    for name, spec in heads.items():
        doc = json.loads((results / name / "results.json").read_text())
        rows = hooks.headline_rows(name, doc["results"], spec)
        assert rows and all(r["value"] for r in rows), name
        assert all(r["verdict"] in ("met", "missed") for r, f in zip(rows, spec["figures"])
                   if "target" in f or "target_path" in f), name
    summary, _, pages = hooks.benchmarks_markdown(results)
    assert "| missed |" in summary or "| met |" in summary
    assert len(pages) == len(hooks.results_files(results))


def test_python_api_reference_is_generated(site: Path) -> None:
    assert "open_index" in _text(site, "reference/qswap-index")
    assert "ServerSettings" in _text(site, "reference/qswap-server")
    assert "load_base" in _text(site, "reference/qswap-encoders")
    assert "require_same" in _text(site, "reference/qswap")


def _copy_config(tmp: Path) -> tuple[Path, Path]:
    """A copy of the docs folder and a config that builds it with the repository's hooks."""
    docs = tmp / "docs"
    shutil.copytree(REPO / "docs", docs, ignore=shutil.ignore_patterns("hooks.py", "__pycache__"))
    cfg = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    cfg["docs_dir"] = str(docs)
    cfg["hooks"] = [str(REPO / "docs" / "hooks.py")]
    cfg["plugins"][2]["mkdocstrings"]["handlers"]["python"]["paths"] = [str(REPO / "build" / "docs-src")]
    config = tmp / "mkdocs.yml"
    config.write_text(yaml.safe_dump(cfg))
    return docs, config


def test_a_new_page_joins_the_nav(tmp_path: Path) -> None:
    docs, config = _copy_config(tmp_path)
    (docs / "brand-new-topic.md").write_text("# Brand new topic\n\nSee [Serving](serving.md).\n")
    r = _build(config, tmp_path / "site")
    assert r.returncode == 0, r.stderr[-6000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "More topics" in home and "brand-new-topic/" in home


@pytest.mark.parametrize("page, expect", [
    # Both broken links in one build (a build takes ~15 s): strict mode reports every warning
    # before it aborts, each naming its link.
    ("[a page that does not exist](nowhere.md)\n\n[an anchor that does not exist](serving.md#no-such-section)",
     ("nowhere.md", "no-such-section")),
    ("::: qswap.no_such_module", ("qswap.no_such_module",)),
], ids=["links", "reference"])
def test_strict_build_fails_on_broken_references(tmp_path: Path, page: str, expect: tuple[str, ...]) -> None:
    docs, config = _copy_config(tmp_path)
    (docs / "concepts.md").write_text((docs / "concepts.md").read_text() + "\n" + page + "\n")
    r = _build(config, tmp_path / "site")
    assert r.returncode != 0
    for name in expect:
        assert name in r.stdout + r.stderr, name
