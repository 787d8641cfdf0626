"""mkdocs hooks: the pages that must never disagree with the code are generated at build time.

- ``<!-- generated: http-api -->`` becomes the HTTP API reference, rendered from the committed
  OpenAPI schema (``server/openapi.json``, which a test keeps equal to the running app's);
- ``<!-- generated: settings -->`` becomes the settings table, read from ``ServerSettings``
  (``server/config.py``) and the ``qswap serve`` flags that set each field;
- ``<!-- generated: benchmarks -->`` becomes the benchmarks summary: the headline figures declared in
  ``bench/results/headlines.toml`` against their targets, and every ``bench/results/**/results.json``
  with its commit and machine, linked to a generated page of its own (command, load, figures, plots).

The nav in ``mkdocs.yml`` lists sections; any ``docs/*.md`` page it does not list is added under
"More topics", so a new page never breaks the build and is never unreachable.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPENAPI = REPO / "server" / "openapi.json"
RESULTS = REPO / "bench" / "results"
MORE_TOPICS = "More topics"
MARKER = re.compile(r"<!--\s*generated:\s*([a-z-]+)\s*-->")
#: Rows of one benchmark's figure table shown at most; the rest stay in its results.json.
MAX_FIGURE_ROWS = 160
_METHODS = ("get", "put", "post", "delete", "patch")
_BOUNDS = {"Ge": "≥", "Gt": ">", "Le": "≤", "Lt": "<"}   # annotated_types bounds pydantic keeps in metadata


# --------------------------------------------------------------------------------------- helpers

def _cell(v: Any) -> str:
    """One Markdown table cell: code for identifiers, pipes and newlines escaped."""
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ------------------------------------------------------------------------------------- HTTP API

def _schema_type(s: Mapping[str, Any]) -> str:
    """A short type for a JSON schema: ``string``, ``integer``, links to named schemas, unions."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in s:
            return " or ".join(_schema_type(x) for x in s[key])
    t = s.get("type")
    if t == "array":
        return "array of " + _schema_type(s.get("items", {}))
    if t == "object" and isinstance(s.get("additionalProperties"), dict):
        return "object of " + _schema_type(s["additionalProperties"])
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    if "enum" in s:
        return " or ".join(f"`{json.dumps(x)}`" for x in s["enum"])
    return str(t or "any")


def _constraints(s: Mapping[str, Any]) -> str:
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
            "minItems", "maxItems", "maxProperties", "pattern", "default")
    return ", ".join(f"{k} `{s[k] if isinstance(s[k], str) else json.dumps(s[k])}`" for k in keys if k in s)


def _schema_section(name: str, s: Mapping[str, Any]) -> list[str]:
    out = [f"### {name} {{#{_anchor(name)}}}", ""]
    if s.get("description"):
        out += [s["description"].strip(), ""]
    props = s.get("properties") or {}
    if props:
        required = set(s.get("required", []))
        out += ["| field | type | required | constraints | description |", "|---|---|---|---|---|"]
        for field, p in props.items():
            out.append(f"| `{field}` | {_cell(_schema_type(p))} | {'yes' if field in required else ''} | "
                       f"{_cell(_constraints(p))} | {_cell((p.get('description') or p.get('title') or '').strip())} |")
        out.append("")
    else:
        out += [f"Type: {_schema_type(s)}.", ""]
    return out


def http_api_markdown(spec: Mapping[str, Any]) -> str:
    """The HTTP API reference (routes, parameters, bodies, answers, schemas) from an OpenAPI document.

    Args:
        spec: the OpenAPI document (``server/openapi.json``).

    Returns:
        Markdown: a route table, one section per operation and one per component schema.
    """
    out = [f"OpenAPI {spec.get('openapi', '')}, API version {spec.get('info', {}).get('version', '')}. "
           "The running server serves the same schema at `/openapi.json` (with its own limits) and "
           "interactive docs at `/docs`.", "",
           "| method | path | what |", "|---|---|---|"]
    ops = [(path, m, op) for path, item in spec.get("paths", {}).items()
           for m, op in item.items() if m in _METHODS]
    for path, m, op in ops:
        out.append(f"| `{m.upper()}` | [`{path}`](#{op['operationId']}) | {_cell(op.get('summary', ''))} |")
    out.append("")
    for path, m, op in ops:
        out += [f"### `{m.upper()} {path}` {{#{op['operationId']}}}", ""]
        if op.get("summary"):
            out += [f"**{op['summary']}**", ""]
        if op.get("description"):
            out += [op["description"].strip(), ""]
        if op.get("security"):
            out += ["Takes a bearer token (`Authorization: Bearer ...`): the admin token on admin routes, "
                    "the search token on the others when the server has one ([Operations](operations.md)).", ""]
        params = op.get("parameters") or []
        if params:
            out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
            for p in params:
                out.append(f"| `{p['name']}` | {p.get('in', '')} | {_cell(_schema_type(p.get('schema', {})))} | "
                           f"{'yes' if p.get('required') else ''} | {_cell(p.get('description', ''))} |")
            out.append("")
        body = op.get("requestBody")
        if body:
            kinds = ", ".join(f"`{ct}`: {_schema_type(c.get('schema', {}))}" for ct, c in body.get("content", {}).items())
            out += [f"Request body{' (required)' if body.get('required') else ''}: {kinds}.", ""]
        responses = op.get("responses") or {}
        if responses:
            out += ["| status | meaning | body |", "|---|---|---|"]
            for code, r in responses.items():
                bodies = ", ".join(_schema_type(c.get("schema", {})) for c in (r.get("content") or {}).values())
                out.append(f"| {code} | {_cell(r.get('description', ''))} | {_cell(bodies)} |")
            out.append("")
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
        for name, s in schemas.items():
            out += _schema_section(name, s)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------- settings

def _serve_flags() -> dict[str, str]:
    """``ServerSettings`` field -> the ``qswap serve`` flag that sets it."""
    import argparse

    from qswap.server import cli as server_cli

    parser = argparse.ArgumentParser()
    server_cli.register(parser.add_subparsers())
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    by_dest = {a.dest: a.option_strings[-1] for a in serve._actions if a.option_strings}
    flags = {field: by_dest[dest] for dest, field in server_cli._FLAG_FIELDS.items() if dest in by_dest}
    flags.setdefault("log_json", "--log-format json|text")
    return flags


def settings_markdown() -> str:
    """The settings table of ``qswap serve``, generated from ``ServerSettings``.

    Returns:
        Markdown: one row per field with its environment variable, flag, type, default and meaning.
    """
    from pydantic_core import PydanticUndefined

    from qswap.server.config import ServerSettings

    flags = _serve_flags()
    prefix = ServerSettings.model_config.get("env_prefix", "")
    out = ["| setting | environment | flag | type | default | what |", "|---|---|---|---|---|---|"]
    for name, f in ServerSettings.model_fields.items():
        if f.default_factory is not None:
            default = "computed at start"
        elif f.default is PydanticUndefined:
            default = "required"
        else:
            default = f"`{json.dumps(f.default) if not isinstance(f.default, str) else f.default}`"
        bounds = ", ".join(f"{_BOUNDS[type(m).__name__]} {getattr(m, type(m).__name__.lower())}"
                           for m in f.metadata if type(m).__name__ in _BOUNDS)
        typ = re.sub(r"\b(typing|pathlib|pydantic\.types)\.", "", str(f.annotation).replace("<class '", "")
                     .replace("'>", ""))
        what = (f.description or "") + (f" ({bounds})" if bounds else "")
        out.append(f"| `{name}` | `{prefix.upper()}{name.upper()}` | {('`' + flags[name] + '`') if name in flags else ''} | "
                   f"{_cell(typ)} | {_cell(default)} | {_cell(what)} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------- benchmarks

def results_files(root: Path = RESULTS) -> list[Path]:
    """Every committed ``results.json`` under ``bench/results`` (scratch ``tmp/`` folders left out)."""
    return sorted(p for p in root.rglob("results.json") if "tmp" not in p.relative_to(root).parts)


def _flatten(o: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(o, Mapping):
        for k, v in o.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(o, list) and o and all(isinstance(x, Mapping) for x in o):
        for i, v in enumerate(o):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, o


def figure_tables(results: Any) -> list[str]:
    """Markdown tables of a results object: its scalars as figure | value, each list of records as a table.

    Args:
        results: the ``results`` member of a results file.

    Returns:
        Markdown lines; at most :data:`MAX_FIGURE_ROWS` rows a table, the rest named as left out.
    """
    scalars: list[tuple[str, Any]] = []
    records: list[tuple[str, list[dict[str, Any]]]] = []

    def walk(o: Any, prefix: str) -> None:
        if isinstance(o, Mapping):
            for k, v in o.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(o, list) and o and all(isinstance(x, Mapping) for x in o):
            records.append((prefix, [dict(_flatten(x)) for x in o]))
        else:
            scalars.append((prefix, o))

    walk(results, "")
    out: list[str] = []
    if scalars:
        out += ["| figure | value |", "|---|---|"]
        out += [f"| `{k}` | {_value(v)} |" for k, v in scalars[:MAX_FIGURE_ROWS]]
        if len(scalars) > MAX_FIGURE_ROWS:
            out.append(f"| ... | {len(scalars) - MAX_FIGURE_ROWS} more in its results.json |")
        out.append("")
    for name, rows in records:
        cols = list(dict.fromkeys(c for r in rows for c in r))
        out += [f"`{name}`:", "", "| " + " | ".join(f"`{c}`" for c in cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_value(r.get(c, "")) for c in cols) + " |" for r in rows[:MAX_FIGURE_ROWS]]
        if len(rows) > MAX_FIGURE_ROWS:
            out.append(f"\n{len(rows) - MAX_FIGURE_ROWS} more rows in its results.json")
        out.append("")
    return out


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 12:
        return _cell(json.dumps(v[:12])[:-1] + f", ... ({len(v)} values)]")
    return _cell(v)


def _provenance(doc: Mapping[str, Any]) -> dict[str, str]:
    meta = doc.get("meta", {})
    m, g = meta.get("machine", {}), meta.get("git", {})
    return {"commit": (g.get("commit") or "unknown")[:12],
            "dirty": " (uncommitted changes)" if g.get("dirty") else "",
            "note": f" ({g['note']})" if g.get("note") else "",
            "cpu": str(m.get("cpu_model") or "?"), "cores": f"{m.get('cores_usable')} usable / {m.get('cores_logical')}",
            "started": str(meta.get("started") or "?")[:10]}


def _page_uri(name: str) -> str:
    # a folder per result set: a set named "index" must not become the folder's index page
    return f"benchmark/{name}/results.md"


def benchmark_section(path: Path, root: Path = RESULTS) -> tuple[str, list[Path]]:
    """One benchmark's page: provenance, plots, then its figures, all read from one results file.

    Args:
        path: a ``results.json`` written by :class:`qswap.bench.results.ResultWriter`.
        root: the results folder the page's title is relative to.

    Returns:
        The Markdown page (its links relative to ``benchmarks/<name>.md``) and the PNG plots it shows.
    """
    doc = json.loads(path.read_text())
    name = str(path.parent.relative_to(root))
    meta, results = doc.get("meta", {}), doc.get("results", {})
    m, pv = meta.get("machine", {}), _provenance(doc)
    load = f"{(m.get('loadavg') or ['?'])[0]} at start, {(meta.get('loadavg_end') or ['?'])[0]} at end"
    up = "../" * _page_uri(name).count("/")
    out = [f"# {name}", "", f"[All benchmarks]({up}benchmarks.md)", "",
           f"- command: `{meta.get('command', '')}`",
           f"- commit: `{pv['commit']}`{pv['dirty']}{pv['note']}",
           f"- machine: {m.get('cpu_model')}, {m.get('cores_usable')} usable / {m.get('cores_logical')} cores, "
           f"{m.get('ram_gib')} GiB RAM; torch threads {m.get('torch_threads')}",
           f"- when: {meta.get('started')}, {meta.get('seconds', 0):.0f} s; load average (1 min) {load}", ""]
    plots = sorted(path.parent.glob("*.png"))
    for p in plots:
        out += [f"![{name}: {p.stem}]({up}bench/{name}/{p.name})", ""]
    out += figure_tables(results)
    return "\n".join(out) + "\n", plots


def _lookup(results: Any, path: list[Any]) -> Any:
    for key in path:
        results = results[key]
    return results


def headline_rows(name: str, results: Any, spec: Mapping[str, Any]) -> list[dict[str, str]]:
    """The summary rows of one benchmark: each declared figure read from its results, with its target.

    Args:
        name: the results folder (relative to ``bench/results``).
        results: the ``results`` member of its results file.
        spec: its entry in ``bench/results/headlines.toml``.

    Returns:
        One row per figure: label, value, target, verdict (met / missed / blank without a target).

    Raises:
        KeyError: a declared path is not in the results (the benchmark's output changed).
    """
    rows = []
    for f in spec.get("figures", []):
        value = _lookup(results, f["path"])
        if "over" in f:
            value = value / _lookup(results, f["over"])
        scale = f.get("scale", 1)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = value * scale if scale != 1 else value
        fmt = f.get("format", "{}")
        text = fmt.format(value) if not isinstance(value, str) else value
        target, verdict = f.get("target", ""), ""
        if "target_path" in f:
            bound = _lookup(results, f["target_path"]) * scale
            target = f"<= {fmt.format(bound)}"
            verdict = "met" if value <= bound else "missed"
        elif target:
            op, bound = target.split()
            ok = value <= float(bound) if op == "<=" else value >= float(bound)
            verdict = "met" if ok else "missed"
        rows.append({"label": f["label"], "value": text, "target": target, "verdict": verdict})
    return rows


def headlines(root: Path = RESULTS) -> dict[str, Any]:
    """``bench/results/headlines.toml``: the figures the summary shows, per results folder."""
    import tomllib
    path = root / "headlines.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def benchmarks_markdown(root: Path = RESULTS) -> tuple[str, list[tuple[str, Path]], list[tuple[str, str]]]:
    """The benchmarks summary, and one page per results file.

    Args:
        root: the ``bench/results`` folder.

    Returns:
        The summary's Markdown (headline figures against their targets, their plots, and every
        result set with its provenance and a link to its page), the plots to copy into the site
        as ``(site path, file on disk)``, and the pages as ``(src uri, Markdown)``.
    """
    heads = headlines(root)
    files = results_files(root)
    summary = ["| benchmark | figure | value | target | | commit | machine |", "|---|---|---|---|---|---|---|"]
    listing = ["| result set | commit | measured | machine |", "|---|---|---|---|"]
    shown_plots, plots, pages = [], [], []
    for path in files:
        doc = json.loads(path.read_text())
        name = str(path.parent.relative_to(root))
        text, pngs = benchmark_section(path, root)
        pages.append((_page_uri(name), text))
        plots += [(f"bench/{name}/{p.name}", p) for p in pngs]
        pv = _provenance(doc)
        link = f"[{name}]({_page_uri(name)})"
        listing.append(f"| {link} | `{pv['commit']}`{pv['dirty']} | {pv['started']} | {_cell(pv['cpu'])} |")
        if name in heads:
            for i, row in enumerate(headline_rows(name, doc.get("results", {}), heads[name])):
                summary.append(f"| {link if i == 0 else ''} | {_cell(row['label'])} | {row['value']} | "
                               f"{_cell(row['target'])} | {row['verdict']} | "
                               f"{('`' + pv['commit'] + '`' + pv['dirty']) if i == 0 else ''} | "
                               f"{_cell(pv['cpu']) if i == 0 else ''} |")
            plot = heads[name].get("plot")
            if plot and (path.parent / plot).exists():
                shown_plots.append(f"![{name}](bench/{name}/{plot})")
    out = ["## Summary", "", *summary, "", *[p + "\n" for p in shown_plots],
           "## Every result set", "",
           "Each links to its page: the command, the machine and load, every figure and plot.", "", *listing, ""]
    return "\n".join(out), plots, pages


# ----------------------------------------------------------------------------------- mkdocs hooks

def _listed(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_listed(x) for x in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_listed(v) for v in nav.values())) if nav else set()
    return set()


def source_tree(dest: Path = REPO / "build" / "docs-src") -> Path:
    """A ``qswap/`` folder of links laid out as the installed package, for mkdocstrings to read.

    pyproject's ``package-dir`` spreads the one import name over several root folders
    (``core/`` is ``qswap``, ``index/`` is ``qswap.index``, ...), which static analysis cannot
    follow. ``mkdocs.yml`` points mkdocstrings at this tree instead.

    Args:
        dest: the folder to (re)build; ``build/`` is git-ignored.

    Returns:
        ``dest``, holding ``qswap/``.
    """
    import tomllib

    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    # Real folders and linked .py files: griffe does not walk into linked folders.
    shutil.rmtree(dest, ignore_errors=True)
    roots = {"qswap": REPO / mapping["qswap"]}
    roots.update({name: REPO / folder for name, folder in mapping.items() if name.count(".") == 1})
    for name, folder in roots.items():
        for src in folder.rglob("*.py"):
            rel = src.relative_to(folder)
            if "__pycache__" in rel.parts or (name == "qswap" and rel.parts[0] in mapping):
                continue
            link = dest.joinpath(*name.split("."), rel)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(src.resolve())
    return dest


# Laid out when mkdocs loads this hook, before any plugin configures: mkdocstrings drops a search
# path that does not exist yet, so on a fresh clone (no build/ folder) the first build found
# `qswap` through the editable install instead and could not collect its subpackages.
source_tree()


def on_config(config: Any) -> Any:
    """Lay out the package for mkdocstrings; add every ``docs/*.md`` page the nav lacks under "More topics"."""
    source_tree()
    nav = config.get("nav")
    if nav is None:
        return config
    docs = Path(config["docs_dir"])
    missing = sorted(p.relative_to(docs).as_posix() for p in docs.glob("*.md")
                     if p.relative_to(docs).as_posix() not in _listed(nav))
    if missing:
        nav.append({MORE_TOPICS: missing})
    return config


def on_files(files: Any, config: Any) -> Any:
    """Put the benchmark plots and one page per result set into the site (pages reached from the
    benchmarks summary, not from the nav)."""
    from mkdocs.structure.files import File, InclusionLevel

    _, plots, pages = benchmarks_markdown()
    for site_path, disk in plots:
        files.append(File.generated(config, site_path, abs_src_path=str(disk)))
    for uri, text in pages:
        page = File.generated(config, uri, content=text)
        page.inclusion = InclusionLevel.NOT_IN_NAV
        files.append(page)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- generated: NAME -->`` marker by its generated Markdown."""
    def fill(match: re.Match[str]) -> str:
        what = match.group(1)
        if what == "http-api":
            return http_api_markdown(json.loads(OPENAPI.read_text()))
        if what == "settings":
            return settings_markdown()
        if what == "benchmarks":
            return benchmarks_markdown()[0]
        raise ValueError(f"{page.file.src_path}: unknown generated block {what!r}")
    return MARKER.sub(fill, markdown)
