"""The Debian package-descriptions retrieval benchmark, built from apt's lists, in BEIR format.

Documents are the English long descriptions of Debian packages; queries are the one-line
short descriptions, in English and in each translated language apt fetched (German,
French, Italian by default: ``apt-get -o Acquire::Languages="en,de,fr,it" update``). A
query's relevant document is the long description of the same package, so the task is
"find the package this synopsis summarises", monolingual for English and cross-lingual
(query in de/fr/it, documents in English) for the rest. Query ids are shared across
languages, so per-language scores compare the same queries.

Construction rules (and why):

- Packages whose long descriptions are identical up to case and whitespace (``-dbg``/
  ``-dev`` variants, cross-compiler builds, ...) fold into one document listing all of them
  in ``metadata.packages``: otherwise one query would have dozens of indistinguishable
  copies of its answer, all but one counted as misses.
- Long descriptions under 40 characters are dropped: they say nothing a query could match.
- Queries with identical English short descriptions fold into one query (id: the first
  package name) whose relevant documents are all their packages' documents, for the same
  reason as the folding of documents.
- Queries are dropped when their English text has fewer than 3 words ("web browser",
  "font editor": hundreds of documents fit, the one labelled answer is arbitrary), when it
  names a transitional/dummy package (their descriptions only say the package can be
  removed), and when it occurs verbatim in its own document (about 6%: "debugging symbols
  for ceph-mon"), which measures substring matching, not an encoder. The same query ids are
  dropped in every language, which keeps languages aligned; dropped queries' documents stay
  in the corpus as distractors.
- A package listed in several Packages files (suites, architectures) takes its first stanza,
  in file-name order, that has an English description.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from qswap.atomic import atomic_write_bytes, fsync_dir, staged_dir
from qswap.beir import jsonl_line, write_jsonl, write_qrels
from qswap.bench.data.aptlists import (
    APT_UPDATE_COMMAND,
    DEFAULT_LISTS_DIR,
    apt_update_command,
    find_packages_files,
    find_translation_files,
    iter_stanzas,
    normalise_text,
    read_release_info,
    split_description,
)
from qswap.errors import ConflictError, InvalidInputError, NotFoundError

FORMAT = "qswap-debian-beir/1"
DEFAULT_LANGS = ("en", "de", "fr", "it")
MIN_DOC_CHARS = 40
MIN_QUERY_WORDS = 3
_TRANSITIONAL_RE = re.compile(r"\b(transitional|dummy)\b", re.IGNORECASE)
_LANG_RE = re.compile(r"^[a-z]{2,3}(_[A-Z]{2})?$")

#: Sections the demo corpus samples from: user-facing software of varied topics.
DEMO_SECTIONS = (
    "science", "games", "sound", "net", "devel", "text", "math", "graphics", "editors",
    "utils", "web", "database", "electronics", "hamradio", "video", "mail",
)
# Library, binding and add-on packages make a dull demo (and near-duplicates of their program).
_DEMO_SKIP_RE = re.compile(
    r"^(lib|python3?-|node-|golang-|r-cran-|r-bioc-|ruby-|php-|perl-|ocaml-|haskell-|elpa-|fonts-)"
    r"|-(dev|dbg|dbgsym|doc|docs|data|common|examples|plugins?|tests?)$"
)


@dataclass
class _Package:
    name: str
    section: str
    source: str
    md5: str  # Description-md5: translations are keyed on it
    short: str  # English short description
    long: str  # English long description, plain text


@dataclass
class _Lists:
    """What the apt lists yield: English packages and the short descriptions per language."""

    packages: dict[str, _Package]
    shorts: dict[str, dict[str, str]]  # lang -> package -> translated short description
    langs_missing: list[str]
    files: list[str]
    counts: dict[str, int] = field(default_factory=dict)


def _bar(it: Iterable[Any], desc: str, progress: bool) -> Iterable[Any]:
    return tqdm(it, desc=desc, unit=" stanzas", file=sys.stderr, disable=not progress, leave=False, mininterval=0.5)


def _strip_section(section: str) -> str:
    # "contrib/sound", "non-free/games" -> the section proper; the archive area is licensing.
    return section.rsplit("/", 1)[-1].strip() or "unknown"


def _read_translations(
    files: list[Path], lang: str, progress: bool
) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """Full descriptions keyed by (package, Description-md5) and by md5 alone."""
    by_key: dict[tuple[str, str], str] = {}
    by_md5: dict[str, str] = {}
    field_name = f"Description-{lang}"
    for path in files:
        for stanza in _bar(iter_stanzas(path), f"read {path.name[-40:]}", progress):
            value = stanza.get(field_name)
            md5 = stanza.get("Description-md5")
            name = stanza.get("Package")
            if value is None or md5 is None or name is None:
                continue  # stanza for another language or incomplete: nothing to take
            by_key.setdefault((name, md5), value)
            by_md5.setdefault(md5, value)
    return by_key, by_md5


def _read_lists(
    lists_dir: Path, langs: Sequence[str], sections: set[str] | None, progress: bool
) -> _Lists:
    lists_dir = Path(lists_dir)
    if not lists_dir.is_dir():
        raise NotFoundError(f"apt lists directory {lists_dir} does not exist", f"run: {APT_UPDATE_COMMAND}")
    packages_files = find_packages_files(lists_dir)
    if not packages_files:
        raise NotFoundError(f"no Packages lists in {lists_dir}", f"run: {APT_UPDATE_COMMAND}")
    en_files = find_translation_files(lists_dir, "en")
    en_key, en_md5 = _read_translations(en_files, "en", progress)
    files = [p.name for p in packages_files + en_files]

    packages: dict[str, _Package] = {}
    counts: Counter[str] = Counter()
    for path in packages_files:
        for stanza in _bar(iter_stanzas(path), f"read {path.name[-40:]}", progress):
            name = stanza.get("Package")
            if name is None:
                raise InvalidInputError(f"{path}: a stanza has no Package field", f"delete the file and run: {APT_UPDATE_COMMAND}")
            if name in packages:
                continue
            description = stanza.get("Description", "")
            md5 = stanza.get("Description-md5", "")
            if "\n" in description:  # lists without Translation-en carry the full text inline
                full: str | None = description
                md5 = md5 or hashlib.md5((description + "\n").encode()).hexdigest()
            else:
                full = en_key.get((name, md5)) or en_md5.get(md5)
            if full is None:
                counts["no_english_description"] += 1
                continue
            short, long = split_description(full)
            source = stanza.get("Source", name).split(" ", 1)[0]
            packages[name] = _Package(name, _strip_section(stanza.get("Section", "")), source, md5, short, long)
    if not packages:
        raise NotFoundError(
            f"no English package descriptions found in {lists_dir} (no Translation-en lists?)", f"run: {APT_UPDATE_COMMAND}"
        )
    if sections is not None:
        before = len(packages)
        packages = {n: p for n, p in packages.items() if p.section in sections}
        counts["other_sections"] = before - len(packages)
        if not packages:
            found = sorted({_strip_section(s) for s in sections})
            raise InvalidInputError(f"no packages in sections {', '.join(found)}", "section names are Debian's: science, games, sound, net, devel, ...")

    shorts: dict[str, dict[str, str]] = {"en": {n: p.short for n, p in packages.items()}}
    langs_missing: list[str] = []
    for lang in langs:
        if lang == "en":
            continue
        tr_files = find_translation_files(lists_dir, lang)
        if not tr_files:
            langs_missing.append(lang)
            print(f"warning: no Translation-{lang} lists in {lists_dir}; run: {apt_update_command(langs)}", file=sys.stderr)
            continue
        files += [p.name for p in tr_files]
        by_key, by_md5 = _read_translations(tr_files, lang, progress)
        got: dict[str, str] = {}
        for name, pkg in packages.items():
            # A translation applies to the exact English text it was made from (its md5).
            value = by_key.get((name, pkg.md5)) or by_md5.get(pkg.md5)
            if value is not None:
                short, _ = split_description(value)
                if short:
                    got[name] = short
        shorts[lang] = got
    return _Lists(packages, shorts, langs_missing, files, dict(counts))


@dataclass
class _Doc:
    id: str
    text: str
    section: str
    packages: list[str]


@dataclass
class _Query:
    id: str
    section: str
    packages: list[str]
    positives: list[str]
    texts: dict[str, str]  # lang -> text


def _doc_id(key: str) -> str:
    return "d" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _majority(values: Iterable[str]) -> str:
    counts = Counter(values)
    return min(counts, key=lambda v: (-counts[v], v))


def _fold_documents(packages: dict[str, _Package], stats: Counter[str]) -> tuple[dict[str, _Doc], dict[str, str]]:
    """One document per distinct (normalised) long description; returns docs and package -> doc id."""
    groups: dict[str, list[str]] = {}
    for name in sorted(packages):
        pkg = packages[name]
        if len(pkg.long.strip()) < MIN_DOC_CHARS:
            stats["packages_long_description_too_short"] += 1
            continue
        groups.setdefault(normalise_text(pkg.long), []).append(name)
    docs: dict[str, _Doc] = {}
    doc_of: dict[str, str] = {}
    for key, names in groups.items():
        doc_id = _doc_id(key)
        if doc_id in docs:  # 64-bit prefix of sha1: a collision means a bug, not bad luck
            raise ConflictError(f"document id collision on {doc_id}", "report this: the id hash must be lengthened")
        docs[doc_id] = _Doc(doc_id, packages[names[0]].long, _majority(packages[n].section for n in names), names)
        for n in names:
            doc_of[n] = doc_id
    return docs, doc_of


def _fold_queries(
    lists: _Lists, docs: dict[str, _Doc], doc_of: dict[str, str], langs: Sequence[str], stats: Counter[str]
) -> list[_Query]:
    groups: dict[str, list[str]] = {}
    for name in sorted(doc_of):
        short = lists.packages[name].short
        if _TRANSITIONAL_RE.search(short):
            stats["queries_dropped_transitional"] += 1
            continue
        if len(short.split()) < MIN_QUERY_WORDS:
            stats["queries_dropped_too_short"] += 1
            continue
        groups.setdefault(normalise_text(short), []).append(name)
    queries = []
    for key, names in groups.items():
        positives = sorted({doc_of[n] for n in names})
        if any(key in normalise_text(docs[d].text) for d in positives):
            stats["queries_dropped_in_document"] += len(names)
            continue
        texts: dict[str, str] = {}
        for lang in langs:
            table = lists.shorts.get(lang)
            if table is None:
                continue
            text = next((table[n] for n in names if n in table), None)
            if text:
                texts[lang] = text
        queries.append(_Query(names[0], lists.packages[names[0]].section, names, positives, texts))
    queries.sort(key=lambda q: q.id)
    return queries


def _subsample(docs: dict[str, _Doc], queries: list[_Query], max_docs: int, seed: int) -> tuple[dict[str, _Doc], list[_Query]]:
    """Keep ``max_docs`` documents drawn with ``seed``, and the queries whose positives all stay."""
    ids = sorted(docs)
    kept = set(random.Random(seed).sample(ids, max_docs))
    return {d: docs[d] for d in ids if d in kept}, [q for q in queries if all(p in kept for p in q.positives)]


def _check_langs(langs: Sequence[str]) -> tuple[str, ...]:
    langs = tuple(dict.fromkeys(langs))
    if not langs:
        raise InvalidInputError("no languages given", "e.g. langs=('en', 'de')")
    for lang in langs:
        if not _LANG_RE.match(lang):
            raise InvalidInputError(f"bad language code {lang!r}", "use Debian's codes: en, de, fr, it, pt_BR, ...")
    return langs


def _public_mode(path: Path, mode: int) -> None:
    # mkstemp/mkdtemp create private (0600/0700) entries; data files should follow the umask.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def _check_out_dir(out_dir: Path) -> None:
    # The build replaces out_dir wholesale: refuse to delete a directory we did not write.
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConflictError(f"{out_dir} exists and is not a directory", "choose another --out")
        if any(out_dir.iterdir()):
            try:
                fmt = json.loads((out_dir / "stats.json").read_text()).get("format")
            except (OSError, ValueError, AttributeError):
                fmt = None
            if fmt != FORMAT:
                raise ConflictError(
                    f"{out_dir} is not empty and holds no Debian benchmark", "choose a new or empty --out (an old build is replaced)"
                )


def build_debian_beir(
    out_dir: Path,
    langs: Sequence[str] = DEFAULT_LANGS,
    max_docs: int | None = None,
    seed: int = 0,
    sections: Iterable[str] | None = None,
    *,
    lists_dir: Path = DEFAULT_LISTS_DIR,
    progress: bool = True,
) -> dict[str, Any]:
    """Build the Debian descriptions benchmark in ``out_dir`` (BEIR layout) and return its stats.

    Writes ``corpus.jsonl``, ``queries-<lang>.jsonl`` and ``qrels/test-<lang>.tsv`` per language
    found, and ``stats.json``. ``max_docs`` keeps a random (``seed``) subset of documents and
    only the queries whose relevant documents are all in it; ``sections`` keeps only packages of
    those Debian sections (archive prefixes like ``contrib/`` are ignored). Languages without
    Translation lists are skipped and listed in ``stats["langs_missing"]``. The directory is
    written next to ``out_dir`` and renamed into place at the end: an interrupted build leaves
    the previous one intact.
    """
    out_dir = Path(out_dir)
    langs = _check_langs(langs)
    if max_docs is not None and max_docs < 1:
        raise InvalidInputError(f"max_docs must be positive, got {max_docs}", "leave it out to keep every document")
    section_set = {s.strip().rsplit("/", 1)[-1] for s in sections if s.strip()} if sections is not None else None
    if section_set is not None and not section_set:
        raise InvalidInputError("empty section list", "e.g. sections=('science', 'games'), or None for all")
    _check_out_dir(out_dir)

    lists = _read_lists(Path(lists_dir), langs, section_set, progress)
    stats: Counter[str] = Counter(lists.counts)
    docs, doc_of = _fold_documents(lists.packages, stats)
    queries = _fold_queries(lists, docs, doc_of, langs, stats)
    all_docs = len(docs)
    if max_docs is not None and max_docs < len(docs):
        docs, queries = _subsample(docs, queries, max_docs, seed)
    out_langs = [lang for lang in langs if lang in lists.shorts]

    with staged_dir(out_dir) as staging:
        write_jsonl(
            staging / "corpus.jsonl",
            (
                {"_id": d.id, "title": "", "text": d.text, "metadata": {"section": d.section, "packages": d.packages}}
                for d in _bar(docs.values(), "write corpus", progress)
            ),
        )
        (staging / "qrels").mkdir()
        n_queries: dict[str, int] = {}
        n_qrels: dict[str, int] = {}
        for lang in out_langs:
            in_lang = [q for q in queries if lang in q.texts]
            n_queries[lang] = write_jsonl(
                staging / f"queries-{lang}.jsonl",
                (
                    {"_id": q.id, "text": q.texts[lang], "metadata": {"section": q.section, "lang": lang, "packages": q.packages}}
                    for q in in_lang
                ),
            )
            n_qrels[lang] = write_qrels(staging / "qrels" / f"test-{lang}.tsv", ((q.id, d, 1) for q in in_lang for d in q.positives))
        result = {
            "format": FORMAT,
            "docs": len(docs),
            "docs_before_subsample": all_docs,
            "packages": sum(len(d.packages) for d in docs.values()),
            "queries": n_queries,
            "qrels": n_qrels,
            "queries_multi_positive": sum(1 for q in queries if len(q.positives) > 1),
            "sections": dict(sorted(Counter(d.section for d in docs.values()).items(), key=lambda kv: (-kv[1], kv[0]))),
            "dropped": dict(sorted(stats.items())),
            "langs_missing": lists.langs_missing,
            "params": {"langs": list(langs), "max_docs": max_docs, "seed": seed, "sections": sorted(section_set) if section_set else None},
            "source": {"lists_dir": str(lists_dir), "files": lists.files, "releases": read_release_info(Path(lists_dir))},
        }
        (staging / "stats.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        for p in [*staging.iterdir(), *(staging / "qrels").iterdir()]:
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(staging / "qrels")
        _public_mode(staging, 0o777)
    return result


def write_demo_corpus(
    path: Path,
    n: int = 400,
    seed: int = 0,
    *,
    lists_dir: Path = DEFAULT_LISTS_DIR,
    sections: Sequence[str] = DEMO_SECTIONS,
    progress: bool = True,
) -> dict[str, Any]:
    """Write a small demo corpus (index JSONL: ``id``, ``text``, ``section``, ``title``) from the lists.

    ``n`` documents spread evenly over ``sections``: English long descriptions of programs
    (library/binding/-dev/-doc packages skipped), one per source package, 150 to 1200
    characters, drawn with ``seed``. Returns ``{"docs": n, "sections": {section: count}}``.
    """
    if n < 1:
        raise InvalidInputError(f"n must be positive, got {n}", "e.g. n=400")
    lists = _read_lists(Path(lists_dir), ("en",), set(sections), progress)
    docs, _ = _fold_documents(lists.packages, Counter())
    by_section: dict[str, list[_Package]] = {s: [] for s in sections}
    for doc in sorted(docs.values(), key=lambda d: d.id):
        rep = lists.packages[min(doc.packages, key=lambda p: (len(p), p))]
        if _DEMO_SKIP_RE.search(rep.name) or _TRANSITIONAL_RE.search(rep.short) or not 150 <= len(doc.text) <= 1200:
            continue
        if doc.section in by_section:
            by_section[doc.section].append(_Package(rep.name, doc.section, rep.source, rep.md5, rep.short, doc.text))
    rng = random.Random(seed)
    for pool in by_section.values():
        rng.shuffle(pool)
    chosen: list[_Package] = []
    sources: set[str] = set()
    # Round-robin over sections, so every section gets its share and a short one only
    # gives up its remaining turns.
    cursors = {s: 0 for s in sections}
    while len(chosen) < n and any(cursors[s] < len(by_section[s]) for s in sections):
        for s in sections:
            pool = by_section[s]
            while cursors[s] < len(pool) and pool[cursors[s]].source in sources:
                cursors[s] += 1
            if cursors[s] < len(pool) and len(chosen) < n:
                pkg = pool[cursors[s]]
                cursors[s] += 1
                sources.add(pkg.source)
                chosen.append(pkg)
    chosen.sort(key=lambda p: p.name)
    data = "".join(jsonl_line({"id": p.name, "text": p.long, "section": p.section, "title": p.short}) for p in chosen)
    atomic_write_bytes(Path(path), data.encode("utf-8"))
    _public_mode(Path(path), 0o666)
    return {"docs": len(chosen), "bytes": len(data.encode()), "sections": dict(sorted(Counter(p.section for p in chosen).items()))}


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench data debian``."""
    parser.add_argument("--out", type=Path, help="benchmark directory to write (replaced if it holds an older build)")
    parser.add_argument("--langs", type=_csv, default=list(DEFAULT_LANGS), help="query languages, comma-separated (default: en,de,fr,it)")
    parser.add_argument("--max-docs", type=int, default=None, help="keep a random subset of this many documents")
    parser.add_argument("--seed", type=int, default=0, help="seed of --max-docs and --demo sampling (default 0)")
    parser.add_argument("--sections", type=_csv, default=None, help="only these Debian sections, comma-separated (e.g. science,games)")
    parser.add_argument("--lists-dir", type=Path, default=DEFAULT_LISTS_DIR, help=f"apt lists (default {DEFAULT_LISTS_DIR})")
    parser.add_argument("--demo", type=Path, default=None, metavar="PATH", help="also (or only) write the demo corpus JSONL here")
    parser.add_argument("--demo-n", type=int, default=400, help="documents in the demo corpus (default 400)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Execute ``qswap bench data debian`` from parsed arguments; prints a summary, returns 0."""
    if args.out is None and args.demo is None:
        raise InvalidInputError("nothing to write", "pass --out DIR (benchmark) and/or --demo PATH (demo corpus)")
    progress = not args.no_progress
    if args.out is not None:
        stats = build_debian_beir(
            args.out, args.langs, args.max_docs, args.seed, args.sections, lists_dir=args.lists_dir, progress=progress
        )
        summary = {k: stats[k] for k in ("docs", "queries", "qrels", "queries_multi_positive", "dropped", "langs_missing")}
        summary["top_sections"] = dict(list(stats["sections"].items())[:10])
        print(f"wrote {args.out}")
        print(json.dumps(summary, indent=2))
    if args.demo is not None:
        sections = tuple(args.sections) if args.sections else DEMO_SECTIONS
        demo = write_demo_corpus(args.demo, args.demo_n, args.seed, lists_dir=args.lists_dir, sections=sections, progress=progress)
        print(f"wrote {args.demo}: {json.dumps(demo)}")
    return 0

