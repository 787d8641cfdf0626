"""Reading and writing retrieval datasets in the BEIR layout: the one reader of the project.

A BEIR directory holds a corpus (``{"_id", "title", "text", "metadata"}`` a line), queries
(``{"_id", "text", "metadata"}`` a line) and ``qrels/<split>.tsv`` (``query-id  corpus-id
score``, tab-separated, header optional). Two layouts are read:

- standard BEIR: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv`` (one language);
- per language (as ``qswap bench data debian`` writes them): ``queries-<lang>.jsonl`` and
  ``qrels/<split>-<lang>.tsv``, query ids shared across languages, and either one shared
  ``corpus.jsonl`` or a ``corpus-<lang>.jsonl`` per language.

Language rules: a corpus asked for in ``lang`` is ``corpus-<lang>.jsonl`` when there is one,
else the shared ``corpus.jsonl``. Queries and qrels in ``lang`` must exist under their
language's own name (falling back to the plain files would label one language's queries as
another's); ``lang=None`` reads the plain files, or English when only per-language files
exist. Every file may also be gzip-compressed (``corpus.jsonl.gz``, ``qrels/test.tsv.gz``).

Bad data raises a named qswap error; bad lines are collected and reported together, up to
five of them as ``file:line: what``.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from qswap.errors import InvalidInputError, NotFoundError

QRELS_HEADER = ("query-id", "corpus-id", "score")
# First-line first fields taken as a qrels header (BEIR's own, and spellings seen in the wild).
_HEADER_FIRST = ("query-id", "query_id", "qid")
_MAX_REPORTED = 5
_LAYOUT_HINT = "point at a BEIR directory (corpus.jsonl, queries.jsonl or queries-<lang>.jsonl, qrels/)"


def document_text(title: str | None, text: str) -> str:
    """The one title rule of the project: what is embedded for a BEIR document.

    ``title + " " + text`` (the BEIR convention, the one E5 was evaluated with); the text alone
    when the title is empty; the title alone when the text is. The index (``qswap.index.corpus``)
    and tuning (:func:`read_corpus`) both embed this, so a tuned encoder learns against the
    document vectors the index holds.
    """
    if title and text:
        return f"{title} {text}"
    return title or text


class BeirDocument(NamedTuple):
    """A corpus entry: the text to embed and the metadata (a non-empty title is in ``metadata["title"]``)."""

    text: str
    metadata: dict[str, Any]


Corpus = dict[str, BeirDocument]
Queries = dict[str, str]
Qrels = dict[str, dict[str, int]]


class BeirDataset(NamedTuple):
    """What :func:`load_beir` returns; unpacks as ``corpus, queries, qrels``."""

    corpus: Corpus
    queries: Queries
    qrels: Qrels


class LineErrors:
    """Collects the bad lines of one file so a single error names several of them."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.items: list[str] = []
        self.count = 0

    def add(self, line: int, what: str) -> None:
        """Record a problem on 1-based line ``line`` (only the first few are kept for the message)."""
        self.count += 1
        if len(self.items) < _MAX_REPORTED:
            self.items.append(f"{self.path.name}:{line}: {what}")

    def raise_if_any(self, hint: str) -> None:
        """Raise :class:`InvalidInputError` listing the recorded problems, if there are any."""
        if self.count:
            more = f" (and {self.count - len(self.items)} more)" if self.count > len(self.items) else ""
            raise InvalidInputError(f"{self.count} bad line(s) in {self.path}: " + "; ".join(self.items) + more, hint)


# --------------------------------------------------------------------------- lines of a file


def _open_binary(path: Path) -> IO[bytes]:
    if not path.exists():
        raise NotFoundError(f"data file {path} does not exist", "check the path")
    if path.is_dir():
        raise InvalidInputError(f"{path} is a directory, not a data file", "give the file inside it")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _lines(path: Path, errors: LineErrors) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line; a line that is not UTF-8 is recorded, not yielded.

    Lines are decoded one by one (not through a text wrapper) so a decoding error keeps
    its line number.
    """
    with _open_binary(path) as f:
        try:
            for no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    errors.add(no, f"not UTF-8 (byte {e.start + 1})")
                    continue
                yield no, (line.lstrip("\ufeff") if no == 1 else line)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise InvalidInputError(f"{path} is not a readable gzip file ({e})",
                                    "recompress it, or drop the .gz suffix if it is plain text") from None


def iter_jsonl(path: Path, errors: LineErrors) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSONL file (gzip when ``.gz``).

    A line that is not a JSON object is recorded in ``errors``, not yielded; the caller
    calls ``errors.raise_if_any`` when done. A file without any non-blank line raises.
    """
    path = Path(path)
    seen = False
    for no, line in _lines(path, errors):
        if not line.strip():
            continue
        seen = True
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            errors.add(no, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(obj, dict):
            errors.add(no, f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield no, obj
    if not seen and not errors.count:
        raise InvalidInputError(f"{path} is empty", "give a JSONL file with one JSON object per line")


# --------------------------------------------------------------------------- finding the files


def _existing(path: Path) -> Path | None:
    """``path`` or its gzip-compressed sibling ``path.gz``, whichever exists (plain first)."""
    for p in (path, path.with_name(path.name + ".gz")):
        if p.is_file():
            return p
    return None


def _require_dir(directory: Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise NotFoundError(f"BEIR directory {directory} does not exist", _LAYOUT_HINT)
    return directory


def available_languages(directory: Path) -> list[str]:
    """Languages with a ``queries-<lang>.jsonl`` (or ``.jsonl.gz``) file in ``directory``, sorted."""
    langs = set()
    for p in Path(directory).glob("queries-*.jsonl*"):
        for suffix in (".jsonl", ".jsonl.gz"):
            if p.name.endswith(suffix) and len(p.name) > len("queries-") + len(suffix):
                langs.add(p.name[len("queries-"):-len(suffix)])
    return sorted(langs)


def resolve_language(directory: Path, lang: str | None) -> str | None:
    """The language whose queries and qrels are read: ``lang``, or for ``None`` the plain files,
    or ``"en"`` when the directory has only per-language files and English among them."""
    if lang is None and _existing(Path(directory) / "queries.jsonl") is None \
            and "en" in available_languages(directory):
        return "en"
    return lang


def _corpus_file(directory: Path, lang: str | None) -> Path:
    directory = _require_dir(directory)
    if lang:
        own = _existing(directory / f"corpus-{lang}.jsonl")
        if own is not None:
            return own
    shared = _existing(directory / "corpus.jsonl")
    if shared is None:
        want = f"corpus-{lang}.jsonl or corpus.jsonl" if lang else "corpus.jsonl"
        raise NotFoundError(f"BEIR directory {directory} has no {want}", _LAYOUT_HINT)
    return shared


def _languages_hint(directory: Path) -> str:
    langs = available_languages(directory)
    if langs:
        return f"languages available: {', '.join(langs)}"
    if _existing(directory / "queries.jsonl") is not None:
        return "this directory has the standard one-language layout (queries.jsonl): give no language"
    return _LAYOUT_HINT


def _queries_file(directory: Path, lang: str | None) -> Path:
    directory = _require_dir(directory)
    lang = resolve_language(directory, lang)
    name = f"queries-{lang}.jsonl" if lang else "queries.jsonl"
    path = _existing(directory / name)
    if path is None:
        raise NotFoundError(f"BEIR directory {directory} has no {name}", _languages_hint(directory))
    return path


def _qrels_file(directory: Path, lang: str | None, split: str) -> Path:
    directory = _require_dir(directory)
    lang = resolve_language(directory, lang)
    name = f"{split}-{lang}.tsv" if lang else f"{split}.tsv"
    path = _existing(directory / "qrels" / name)
    if path is None:
        have = sorted(p.name for p in (directory / "qrels").glob("*.tsv*")) if (directory / "qrels").is_dir() else []
        raise NotFoundError(f"BEIR directory {directory} has no qrels/{name}",
                            f"qrels files there: {', '.join(have)}" if have
                            else f"the split {split!r} does not exist for this dataset")
    return path


# --------------------------------------------------------------------------- reading one file


def _id_of(obj: dict[str, Any]) -> tuple[str | None, str]:
    """``(id, "")``, or ``(None, problem)``. Numeric ids (some BEIR sets use them) become
    strings, since qrels name them as text."""
    v = obj.get("_id")
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v), ""
    if isinstance(v, str) and v:
        return v, ""
    return None, ("missing field '_id'" if v is None else "field '_id' must be a non-empty string or an integer")


def _unique_lines(path: Path, errors: LineErrors, read: Callable[[dict[str, Any]], tuple[Any, str]]) -> dict[str, Any]:
    """``_id -> read(line)`` over a JSONL file, each bad line recorded in ``errors``: one without a
    valid ``_id``, one ``read`` refuses (it returns ``(None, why)``), one repeating an ``_id``."""
    out: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    for no, obj in iter_jsonl(path, errors):
        key, problem = _id_of(obj)
        value = None
        if key is not None:
            value, problem = read(obj)
        if key is None or value is None:
            errors.add(no, problem)
        elif key in first_line:
            errors.add(no, f"duplicate _id {key!r} (first on line {first_line[key]})")
        else:
            first_line[key] = no
            out[key] = value
    return out


def _read_corpus_file(path: Path, prepend_title: bool) -> Corpus:
    def document(obj: dict[str, Any]) -> tuple[BeirDocument | None, str]:
        text = obj.get("text")
        if not isinstance(text, str):
            return None, "missing field 'text'" if text is None else "field 'text' must be a string"
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict):
            return None, "field 'metadata' must be an object"
        title = obj.get("title")
        title = title if isinstance(title, str) else ""
        full = document_text(title, text) if prepend_title else text
        if not full.strip():
            return None, "empty document" + ("" if prepend_title else " (its title, if any, is not embedded)")
        return BeirDocument(full, {**meta, "title": title} if title else dict(meta)), ""

    errors = LineErrors(path)
    corpus = _unique_lines(path, errors, document)
    errors.raise_if_any('corpus lines are {"_id": str, "title": str, "text": str, "metadata": {...}}, ids unique')
    return corpus


def _read_queries_file(path: Path) -> Queries:
    def query(obj: dict[str, Any]) -> tuple[str | None, str]:
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            return None, "missing field 'text'" if text is None else "field 'text' must be a non-empty string"
        return text, ""

    errors = LineErrors(path)
    queries = _unique_lines(path, errors, query)
    errors.raise_if_any('query lines are {"_id": str, "text": str}, ids unique')
    return queries


def _score(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        pass
    try:
        f = float(s)
    except ValueError:
        return None
    return int(f) if f.is_integer() else None   # "1.0" is a grade; "0.5" is not


def _qrels_rows(path: Path) -> list[tuple[int, str, str, int]]:
    """(line number, query id, document id, grade) of every judgement line."""
    errors = LineErrors(path)
    rows = []
    for no, line in _lines(path, errors):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.rstrip("\r\n").split("\t")]
        if no == 1 and parts[0] in _HEADER_FIRST:
            continue
        if len(parts) != 3:
            errors.add(no, f"expected 3 tab-separated columns, got {len(parts)}")
            continue
        qid, did, score_s = parts
        if not qid or not did:
            errors.add(no, "empty query-id or corpus-id")
            continue
        grade = _score(score_s)
        if grade is None:
            errors.add(no, f"score {score_s!r} is not an integer")
            continue
        rows.append((no, qid, did, grade))
    errors.raise_if_any("qrels lines are 'query-id<TAB>corpus-id<TAB>score' with integer scores")
    if not rows:
        raise InvalidInputError(f"{path} has no judgements", "give at least one query-id/corpus-id/score line")
    return rows


# --------------------------------------------------------------------------- public readers


def read_corpus(directory: Path, lang: str | None = None, *, prepend_title: bool = True) -> Corpus:
    """``{doc_id: BeirDocument(text, metadata)}`` of ``corpus-<lang>.jsonl``, else ``corpus.jsonl``.

    ``text`` is what is embedded: :func:`document_text` (title + text, the index's rule) by
    default; ``prepend_title=False`` gives the body alone. A non-empty title is also kept in
    ``metadata["title"]``. Order is file order.
    """
    return _read_corpus_file(_corpus_file(directory, lang), prepend_title)


def read_queries(directory: Path, lang: str | None = None) -> Queries:
    """``{query_id: text}`` of ``queries-<lang>.jsonl`` (``lang=None``: see :func:`resolve_language`), file order."""
    return _read_queries_file(_queries_file(directory, lang))


def read_qrels(directory: Path, lang: str | None = None, *, split: str = "test") -> Qrels:
    """``{query_id: {doc_id: grade}}`` of ``qrels/<split>[-<lang>].tsv``, unchecked against
    queries and corpus (:func:`load_beir` checks)."""
    out: Qrels = {}
    for _, qid, did, grade in _qrels_rows(_qrels_file(directory, lang, split)):
        out.setdefault(qid, {})[did] = grade
    return out


def load_beir(directory: Path, lang: str | None = None, *, split: str = "test", strict: bool = True,
              corpus_lang: str | None = None, prepend_title: bool = True) -> BeirDataset:
    """Load a BEIR dataset: ``(corpus, queries, qrels)`` for query language ``lang``.

    ``corpus`` is read in ``corpus_lang`` (default ``lang``; see :func:`read_corpus`, also for
    ``prepend_title``). ``queries`` holds only the queries that keep a judgement in ``split``
    (as BEIR's own loader does), in queries-file order. A qrels row naming a query or a
    document the dataset lacks raises :class:`InvalidInputError` with its line number when
    ``strict`` (the default); otherwise it is dropped. Every file is found before any is
    read, so a wrong language fails at once.
    """
    directory = Path(directory)
    corpus_path = _corpus_file(directory, corpus_lang if corpus_lang is not None else lang)
    queries_path = _queries_file(directory, lang)
    qrels_path = _qrels_file(directory, lang, split)
    corpus = _read_corpus_file(corpus_path, prepend_title)
    all_queries = _read_queries_file(queries_path)
    errors = LineErrors(qrels_path)
    qrels: Qrels = {}
    for no, qid, did, grade in _qrels_rows(qrels_path):
        if qid not in all_queries:
            if strict:
                errors.add(no, f"query {qid!r} is not in {queries_path.name}")
            continue
        if did not in corpus:
            if strict:
                errors.add(no, f"document {did!r} (query {qid!r}) is not in {corpus_path.name}")
            continue
        qrels.setdefault(qid, {})[did] = grade
    errors.raise_if_any("every qrels row must name a known query and document; strict=False drops the others")
    if not qrels:
        raise InvalidInputError(f"no row of {qrels_path} names a query of {queries_path.name} and a document of "
                                f"{corpus_path.name}", "check that the three files belong to one dataset")
    queries = {qid: text for qid, text in all_queries.items() if qid in qrels}
    return BeirDataset(corpus, queries, qrels)


def check_beir(directory: Path, lang: str | None = None, *, split: str = "test",
               corpus_lang: str | None = None) -> None:
    """Find (not read) the corpus, queries and qrels :func:`load_beir` would read; a missing
    one raises its :class:`NotFoundError` at once (validating a run's languages before any work)."""
    _corpus_file(directory, corpus_lang if corpus_lang is not None else lang)
    _queries_file(directory, lang)
    _qrels_file(directory, lang, split)


# --------------------------------------------------------------------------- writers


def jsonl_line(obj: dict[str, Any]) -> str:
    """One compact JSON line (UTF-8 kept readable, keys in the given order)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _open_write(path: Path) -> IO[str]:
    path = Path(path)
    if path.suffix == ".gz":
        # mtime=0: the same rows give the same bytes (builds are compared and checksummed).
        return io.TextIOWrapper(gzip.GzipFile(path, "wb", mtime=0), encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON lines (gzip when ``.gz``); returns the count. Not atomic: the caller
    writes into a staging directory it swaps in (see :func:`qswap.atomic.replace_dir`)."""
    n = 0
    with _open_write(path) as f:
        for row in rows:
            f.write(jsonl_line(row))
            n += 1
    return n


def write_qrels(path: Path, rows: Iterable[tuple[str, str, int]]) -> int:
    """Write a BEIR qrels tsv with its header (gzip when ``.gz``); returns the number of rows."""
    n = 0
    with _open_write(path) as f:
        f.write("\t".join(QRELS_HEADER) + "\n")
        for qid, doc_id, score in rows:
            f.write(f"{qid}\t{doc_id}\t{score}\n")
            n += 1
    return n

