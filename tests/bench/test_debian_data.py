"""The Debian descriptions benchmark builder and the demo corpus (the BEIR reader: tests/core/test_beir.py).

Unit tests build from tiny apt lists written in the real deb822 format; the slow test
builds from the real lists in /var/lib/apt/lists.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qswap.beir import load_beir
from qswap.bench.data import aptlists, debian
from qswap.bench.data.aptlists import split_description
from qswap.bench.data.debian import build_debian_beir, write_demo_corpus
from qswap.errors import ConflictError, InvalidInputError, NotFoundError

REPO = Path(__file__).resolve().parents[2]
ENGINE = "This engine simulates the molecular dynamics of proteins in water, with force fields for lipids."

# name -> (section, short, long paragraphs); a paragraph that is a list is written verbatim.
PACKAGES = {
    "alpha": ("science", "molecular dynamics simulator for proteins", [ENGINE, ["* GPU support", "* MPI support"]]),
    # Same long text, wrapped and cased differently: must fold into alpha's document.
    "alpha-dbg": ("debug", "debugging symbols for the simulator", [ENGINE.upper(), ["* GPU support", "* MPI support"]]),
    "alpha-doc": ("science", "manual of the molecular dynamics simulator", [ENGINE, ["* GPU support", "* MPI support"]]),
    "beta": ("contrib/games", "puzzle game with falling coloured blocks", ["Stack the blocks so that rows disappear; levels get faster."]),
    "gamma": ("games", "block game", ["A second game about blocks, with a level editor and network play."]),
    "delta": ("science", "tiny description of a package", ["Too short."]),
    "eps": ("sound", "audio file converter", ["The audio file converter turns WAV files into FLAC and Ogg Vorbis."]),
    "zeta": ("oldlibs", "transitional package for zeta", ["This package can be safely removed once nothing depends on it."]),
    "eta1": ("math", "library for linear algebra", ["Dense matrix routines in the style of LAPACK, version one of the API."]),
    "eta2": ("math", "library for linear algebra", ["Sparse matrix routines with iterative solvers, version two of the API."]),
}
TRANSLATIONS = {
    "de": {"alpha": "Simulator für Moleküldynamik von Proteinen", "beta": "Puzzlespiel mit fallenden farbigen Blöcken",
           "eta2": "Bibliothek für lineare Algebra"},
    "fr": {"beta": "jeu de réflexion avec des blocs colorés"},
}


def _deb_long(paragraphs: list) -> str:
    lines = []
    for i, para in enumerate(paragraphs):
        if i:
            lines.append(" .")
        if isinstance(para, list):
            lines += [f"  {item}" for item in para]  # two spaces: verbatim
        else:
            words, line = para.split(), ""
            for w in words:  # wrap at 30 columns, so folding must ignore line breaks
                if len(line) + len(w) > 30:
                    lines.append(" " + line.strip())
                    line = ""
                line += " " + w
            lines.append(" " + line.strip())
    return "\n".join(lines)


def _full(name: str, packages: dict = PACKAGES) -> str:
    _, short, paras = packages[name]
    return f"{short}\n{_deb_long(paras)}"


def _md5(name: str, packages: dict = PACKAGES) -> str:
    return hashlib.md5((_full(name, packages) + "\n").encode()).hexdigest()


def write_lists(d: Path, packages: dict = PACKAGES, translations: dict = TRANSLATIONS, sources: dict | None = None) -> Path:
    """Fake /var/lib/apt/lists: plain Packages, gzip Translation-en, plain Translation-de/fr."""
    d.mkdir(parents=True, exist_ok=True)
    pk = []
    for name, (section, short, _) in packages.items():
        source = f"Source: {sources[name]} (1.0-1)\n" if sources and name in sources else ""
        pk.append(f"Package: {name}\n{source}Version: 1.0-1\nArchitecture: amd64\nDescription: {short}\n"
                  f"Description-md5: {_md5(name, packages)}\nTag: role::program,\n use::simulating\nSection: {section}\n")
    (d / "deb.example.org_debian_dists_test_main_binary-amd64_Packages").write_text("\n".join(pk))
    en = "".join(f"Package: {n}\nDescription-md5: {_md5(n, packages)}\nDescription-en: {_full(n, packages)}\n\n" for n in packages)
    with gzip.open(d / "deb.example.org_debian_dists_test_main_i18n_Translation-en.gz", "wt", encoding="utf-8") as f:
        f.write(en)
    for lang, table in translations.items():
        text = "".join(
            f"Package: {n}\nDescription-md5: {_md5(n, packages)}\nDescription-{lang}: {short}\n Übersetzt.\n\n"
            for n, short in table.items()
        )
        (d / f"deb.example.org_debian_dists_test_main_i18n_Translation-{lang}").write_text(text)
    (d / "deb.example.org_debian_dists_test_InRelease").write_text(
        "Origin: Example\nSuite: test\nDate: Sat, 01 Jan 2000 00:00:00 UTC\nSHA256:\n")
    return d


@pytest.fixture
def lists(tmp_path: Path) -> Path:
    return write_lists(tmp_path / "lists")


def _build(lists: Path, out: Path, **kw):
    return build_debian_beir(out, lists_dir=lists, progress=False, **kw)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _qrels(path: Path) -> list[tuple[str, str, str]]:
    lines = path.read_text().splitlines()
    assert lines[0] == "query-id\tcorpus-id\tscore"
    return [tuple(line.split("\t")) for line in lines[1:]]


def _doc_of(out: Path) -> dict[str, str]:
    return {p: r["_id"] for r in _rows(out / "corpus.jsonl") for p in r["metadata"]["packages"]}


# --- descriptions -------------------------------------------------------------------

def test_split_description_paragraphs_and_verbatim():
    short, long = split_description("Synopsis here\n first line\n second line\n .\n   * item one\n   * item two\n .\n last")
    assert short == "Synopsis here"
    assert long == "first line second line\n\n * item one\n * item two\n\nlast"


# --- building -----------------------------------------------------------------------

def test_duplicates_fold_into_one_document(lists, tmp_path):
    out = tmp_path / "out"
    stats = _build(lists, out)
    corpus = _rows(out / "corpus.jsonl")
    alpha = [r for r in corpus if "alpha" in r["metadata"]["packages"]]
    assert len(alpha) == 1
    assert alpha[0]["metadata"]["packages"] == ["alpha", "alpha-dbg", "alpha-doc"]
    assert alpha[0]["metadata"]["section"] == "science"  # 2 of 3 packages
    assert alpha[0]["text"].startswith(ENGINE) and "\n\n* GPU support\n* MPI support" in alpha[0]["text"]
    assert alpha[0]["title"] == ""  # the title would be the short description: the query itself
    # alpha, beta, gamma, eps, zeta, eta1, eta2 (delta's text is under 40 characters)
    assert stats["docs"] == len(corpus) == 7
    assert "delta" not in _doc_of(out)
    assert {r["metadata"]["section"] for r in corpus} >= {"games", "sound", "math"}  # contrib/ stripped
    assert len({r["_id"] for r in corpus}) == len(corpus)


def test_queries_dropped_and_folded(lists, tmp_path):
    out = tmp_path / "out"
    stats = _build(lists, out)
    queries = {r["_id"]: r for r in _rows(out / "queries-en.jsonl")}
    # gamma: 2 words; eps: occurs in its document; zeta: transitional; delta: no document
    assert set(queries) == {"alpha", "alpha-dbg", "alpha-doc", "beta", "eta1"}
    assert stats["dropped"]["queries_dropped_too_short"] == 1
    assert stats["dropped"]["queries_dropped_in_document"] == 1
    assert stats["dropped"]["queries_dropped_transitional"] == 1
    assert stats["dropped"]["packages_long_description_too_short"] == 1
    # eta1 and eta2 share their short description: one query, both documents relevant
    assert queries["eta1"]["metadata"]["packages"] == ["eta1", "eta2"]
    doc_of = _doc_of(out)
    rels = [r for r in _qrels(out / "qrels" / "test-en.tsv") if r[0] == "eta1"]
    assert sorted(r[1] for r in rels) == sorted([doc_of["eta1"], doc_of["eta2"]])
    assert stats["queries_multi_positive"] == 1
    # gamma's document stays as a distractor
    assert "gamma" in doc_of


def test_qrels_consistent_with_corpus_and_queries(lists, tmp_path):
    out = tmp_path / "out"
    stats = _build(lists, out)
    doc_ids = {r["_id"] for r in _rows(out / "corpus.jsonl")}
    doc_of = _doc_of(out)
    for lang in ("en", "de", "fr"):
        qids = {r["_id"] for r in _rows(out / f"queries-{lang}.jsonl")}
        rows = _qrels(out / "qrels" / f"test-{lang}.tsv")
        assert {q for q, _, _ in rows} == qids
        assert all(d in doc_ids and s == "1" for _, d, s in rows)
        assert len(rows) == stats["qrels"][lang]
        # the relevant documents of a query are exactly its packages' descriptions
        packages_of = {r["_id"]: r["metadata"]["packages"] for r in _rows(out / f"queries-{lang}.jsonl")}
        for qid, pkgs in packages_of.items():
            assert {d for q, d, _ in rows if q == qid} == {doc_of[p] for p in pkgs}
        corpus, queries, qrels = load_beir(out, lang)
        assert set(queries) == qids and set(corpus) == doc_ids
        assert sum(len(v) for v in qrels.values()) == len(rows)


def test_languages_aligned(lists, tmp_path):
    out = tmp_path / "out"
    stats = _build(lists, out)
    en = {r["_id"]: r for r in _rows(out / "queries-en.jsonl")}
    de = {r["_id"]: r for r in _rows(out / "queries-de.jsonl")}
    fr = {r["_id"]: r for r in _rows(out / "queries-fr.jsonl")}
    assert set(de) == {"alpha", "beta", "eta1"}  # eta1 takes the translation of eta2, its group
    assert set(fr) == {"beta"}
    assert de["alpha"]["text"] == "Simulator für Moleküldynamik von Proteinen"
    assert de["eta1"]["text"] == "Bibliothek für lineare Algebra"
    assert de["alpha"]["metadata"] == {"section": "science", "lang": "de", "packages": ["alpha"]}
    assert en["alpha"]["text"] == "molecular dynamics simulator for proteins"
    qrels = {lang: {(q, d) for q, d, _ in _qrels(out / "qrels" / f"test-{lang}.tsv")} for lang in ("en", "de", "fr")}
    assert qrels["de"] == {(q, d) for q, d in qrels["en"] if q in de}
    assert qrels["fr"] == {(q, d) for q, d in qrels["en"] if q in fr}
    assert stats["queries"] == {"en": 5, "de": 3, "fr": 1}
    assert stats["langs_missing"] == ["it"]
    assert not (out / "queries-it.jsonl").exists()


def test_outdated_translation_is_not_used(tmp_path):
    """A translation is keyed on the md5 of the English text it translates."""
    d = write_lists(tmp_path / "lists")
    p = d / "deb.example.org_debian_dists_test_main_i18n_Translation-fr"
    p.write_text(p.read_text().replace(_md5("beta"), "0" * 32))
    _build(d, tmp_path / "out")
    assert _rows(tmp_path / "out" / "queries-fr.jsonl") == []


def test_subsample_is_deterministic_and_keeps_positives(tmp_path):
    many = {f"pkg{i:02d}": ("science" if i % 2 else "games", f"program number {i} for some task",
                            [f"Package {i} does one particular thing, described at length here: {'x' * i}."]) for i in range(40)}
    d = write_lists(tmp_path / "lists", many, {"de": {f"pkg{i:02d}": f"Programm {i} für etwas" for i in range(0, 40, 3)}})

    def corpus_ids(out):
        return [r["_id"] for r in _rows(out / "corpus.jsonl")]

    s1 = _build(d, tmp_path / "a", max_docs=15, seed=1)
    _build(d, tmp_path / "b", max_docs=15, seed=1)
    _build(d, tmp_path / "c", max_docs=15, seed=2)
    assert corpus_ids(tmp_path / "a") == corpus_ids(tmp_path / "b")
    assert corpus_ids(tmp_path / "a") != corpus_ids(tmp_path / "c")
    assert s1["docs"] == 15 and s1["docs_before_subsample"] == 40
    kept = set(corpus_ids(tmp_path / "a"))
    for lang in ("en", "de"):
        rows = _qrels(tmp_path / "a" / "qrels" / f"test-{lang}.tsv")
        assert rows and all(doc in kept for _, doc, _ in rows)
    assert s1["queries"]["en"] == 15  # one query per document here, none lost
    # max_docs above the corpus size keeps everything
    assert _build(d, tmp_path / "e", max_docs=1000)["docs"] == 40


def test_sections_filter(lists, tmp_path):
    out = tmp_path / "out"
    stats = _build(lists, out, sections=["games", "contrib/sound"])
    corpus = _rows(out / "corpus.jsonl")
    assert {r["metadata"]["section"] for r in corpus} == {"games", "sound"}
    assert {p for r in corpus for p in r["metadata"]["packages"]} == {"beta", "gamma", "eps"}
    assert stats["sections"] == {"games": 2, "sound": 1}
    with pytest.raises(InvalidInputError, match="no packages in sections"):
        _build(lists, tmp_path / "none", sections=["nonexistent"])


# --- bad input and atomic output ----------------------------------------------------

def test_missing_lists_name_the_apt_command(tmp_path):
    with pytest.raises(NotFoundError, match="does not exist") as e:
        _build(tmp_path / "nope", tmp_path / "out")
    assert "Acquire::Languages" in e.value.hint
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="no Packages lists") as e:
        _build(tmp_path / "empty", tmp_path / "out")
    assert "apt-get" in e.value.hint
    d = write_lists(tmp_path / "lists")
    (d / "deb.example.org_debian_dists_test_main_i18n_Translation-en.gz").unlink()
    with pytest.raises(NotFoundError, match="no English package descriptions"):
        _build(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_malformed_list_reports_file_and_line(lists, tmp_path):
    p = lists / "deb.example.org_debian_dists_test_main_i18n_Translation-de"
    p.write_text(" stray continuation\n" + p.read_text())
    with pytest.raises(InvalidInputError, match=r"Translation-de:1: continuation line outside a field"):
        _build(lists, tmp_path / "out")
    p.write_text("Package: alpha\nthis line has no colon\n")
    with pytest.raises(InvalidInputError, match=r"Translation-de:2: expected 'Field: value'"):
        _build(lists, tmp_path / "out")
    p.write_bytes(b"Package: alpha\nDescription-de: \xff\xfe\n")
    with pytest.raises(InvalidInputError, match=r"Translation-de:2: not UTF-8"):
        _build(lists, tmp_path / "out")


def test_corrupt_compressed_list(lists, tmp_path):
    p = lists / "deb.example.org_debian_dists_test_main_i18n_Translation-en.gz"
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(InvalidInputError, match="cannot decompress"):
        _build(lists, tmp_path / "out")


def _lz4_compress(src: Path, dst: Path) -> None:
    try:
        import lz4.frame  # type: ignore[import-not-found]

        dst.write_bytes(lz4.frame.compress(src.read_bytes()))
    except ImportError:
        lz4 = shutil.which("lz4")
        assert lz4, "lz4 support needs the Python package 'lz4' or the Debian package 'lz4' (apt-get install lz4)"
        subprocess.run([lz4, "-q", "-f", str(src), str(dst)], check=True)


def test_lz4_lists(lists, tmp_path):
    """apt's lz4-compressed lists (the Debian/Ubuntu container default) read like plain ones."""
    _build(lists, tmp_path / "plain")
    src = lists / "deb.example.org_debian_dists_test_main_binary-amd64_Packages"
    _lz4_compress(src, src.with_name(src.name + ".lz4"))
    src.unlink()
    _build(lists, tmp_path / "lz4")
    assert (tmp_path / "lz4" / "corpus.jsonl").read_bytes() == (tmp_path / "plain" / "corpus.jsonl").read_bytes()
    lz = src.with_name(src.name + ".lz4")
    lz.write_bytes(lz.read_bytes()[:-30])  # truncated frame
    with pytest.raises(InvalidInputError, match="lz4"):
        _build(lists, tmp_path / "bad")


def test_lz4_without_decoder_says_what_to_install(lists, tmp_path, monkeypatch):
    src = lists / "deb.example.org_debian_dists_test_main_binary-amd64_Packages"
    _lz4_compress(src, src.with_name(src.name + ".lz4"))
    src.unlink()
    monkeypatch.setitem(sys.modules, "lz4", None)  # `import lz4.frame` now raises ImportError
    monkeypatch.setattr(aptlists.shutil, "which", lambda name: None)
    with pytest.raises(NotFoundError, match="lz4cat") as e:
        _build(lists, tmp_path / "out")
    assert "apt-get install lz4" in e.value.hint


def test_output_replaced_atomically(lists, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _build(lists, out)
    before = (out / "corpus.jsonl").read_bytes()
    _build(lists, out, sections=["games"])  # an older build is replaced
    assert (out / "corpus.jsonl").read_bytes() != before
    after = (out / "corpus.jsonl").read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(debian, "write_qrels", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        _build(lists, out)
    assert (out / "corpus.jsonl").read_bytes() == after  # the interrupted build left the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lists", "out"]  # no staging left behind


def test_refuses_to_replace_a_foreign_directory(lists, tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(ConflictError, match="not empty"):
        _build(lists, foreign)
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_bad_arguments(lists, tmp_path):
    with pytest.raises(InvalidInputError, match="max_docs"):
        _build(lists, tmp_path / "o", max_docs=0)
    with pytest.raises(InvalidInputError, match="language code"):
        _build(lists, tmp_path / "o", langs=["en", "../x"])


def test_cli(lists, tmp_path, capsys):
    from qswap.bench.data.cli import main

    out = tmp_path / "out"
    assert main(["debian", "--out", str(out), "--lists-dir", str(lists), "--langs", "en,de", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert '"de": 3' in printed and sorted(p.name for p in out.iterdir()) == ["corpus.jsonl", "qrels", "queries-de.jsonl", "queries-en.jsonl", "stats.json"]
    assert main(["debian", "--out", str(out), "--lists-dir", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "apt-get" in capsys.readouterr().err
    assert main(["debian", "--no-progress"]) == 2


# --- the demo corpus ----------------------------------------------------------------

def test_write_demo_corpus_from_lists(tmp_path):
    def long(topic):
        return [f"This program is about {topic}. " + "It has many features that are described in this long paragraph. " * 3]

    pkgs = {
        "stellar": ("science", "star catalogue browser", long("stars")),
        "stellar-gtk": ("science", "star catalogue browser (GTK)", long("stars with a GTK interface")),  # same source
        "libstellar1": ("libs", "star catalogue library", long("a library")),  # section not asked for
        "python3-stellar": ("science", "star catalogue Python module", long("Python bindings")),  # a binding
        "chess": ("games", "chess game for two players", long("chess")),
        "go-game": ("games", "the board game go", long("go")),
        "synth": ("sound", "software synthesizer", long("sound synthesis")),
        "short": ("sound", "short description only", ["Too short to be a demo document."]),
    }
    lists = write_lists(tmp_path / "lists", pkgs, {}, sources={"stellar-gtk": "stellar"})
    path = tmp_path / "demo.jsonl"
    sections = ("science", "games", "sound")
    info = write_demo_corpus(path, n=10, seed=0, lists_dir=lists, sections=sections, progress=False)
    rows = _rows(path)
    assert info["docs"] == len(rows) == 4
    assert all(set(r) == {"id", "text", "section", "title"} for r in rows)
    ids = {r["id"] for r in rows}
    assert ids - {"stellar", "stellar-gtk"} == {"chess", "go-game", "synth"}  # one per source package
    assert info["sections"] == {"games": 2, "science": 1, "sound": 1}
    assert {r["id"]: r["title"] for r in rows}["chess"] == "chess game for two players"
    # n smaller than the pool: round-robin over sections, reproducible with the seed
    info = write_demo_corpus(tmp_path / "a.jsonl", n=3, seed=5, lists_dir=lists, sections=sections, progress=False)
    assert info["sections"] == {"games": 1, "science": 1, "sound": 1}
    write_demo_corpus(tmp_path / "b.jsonl", n=3, seed=5, lists_dir=lists, sections=sections, progress=False)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_bundled_demo_corpus_is_well_formed():
    path = REPO / "core" / "data" / "demo_corpus.jsonl"
    assert path.stat().st_size < 400_000
    rows = _rows(path)
    assert 350 <= len(rows) <= 450
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(set(r) == {"id", "text", "section", "title"} and len(r["text"]) >= 150 and r["title"] for r in rows)
    sections = {r["section"] for r in rows}
    assert {"science", "games", "sound", "net", "devel", "text", "math"} <= sections


# --- the real lists -----------------------------------------------------------------

@pytest.mark.slow
def test_build_from_real_apt_lists(tmp_path):
    lists_dir = aptlists.DEFAULT_LISTS_DIR
    have = {lang: bool(lists_dir.is_dir() and aptlists.find_translation_files(lists_dir, lang)) for lang in ("en", "de", "fr", "it")}
    assert lists_dir.is_dir() and aptlists.find_packages_files(lists_dir) and all(have.values()), (
        f"Debian apt lists with translations are missing in {lists_dir} (found: {have}); "
        f"run as root: {aptlists.APT_UPDATE_COMMAND}"
    )
    out = tmp_path / "debian"
    stats = build_debian_beir(out, progress=False)
    assert stats["langs_missing"] == []
    assert stats["docs"] > 20_000 and stats["queries"]["en"] > 20_000
    for lang in ("de", "fr", "it"):
        assert 1_000 < stats["queries"][lang] <= stats["queries"]["en"]
    en_ids = set(load_beir(out, "en")[1])
    for lang in ("de", "fr", "it"):
        corpus, queries, qrels = load_beir(out, lang)  # strict: every qrels row resolves
        assert set(queries) <= en_ids
        assert all(rels and all(s == 1 for s in rels.values()) for rels in qrels.values())
    assert {"science", "games", "sound", "net", "devel", "math"} <= set(stats["sections"])
