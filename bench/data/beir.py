"""Reading (and writing) retrieval benchmarks in the BEIR layout.

A BEIR dataset directory holds ``corpus.jsonl`` (``{"_id", "title", "text", "metadata"}``),
a queries file (``{"_id", "text", "metadata"}``) and ``qrels/<split>.tsv`` (header
``query-id  corpus-id  score``, tab-separated). Two layouts are read:

- standard BEIR: ``queries.jsonl`` + ``qrels/test.tsv`` (one language);
- per language, as :mod:`qswap.bench.data.debian` writes: ``queries-<lang>.jsonl`` +
  ``qrels/test-<lang>.tsv``, query ids shared across languages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from qswap.errors import InvalidInputError, NotFoundError

QRELS_HEADER = ("query-id", "corpus-id", "score")

Corpus = dict[str, tuple[str, dict[str, Any]]]
Queries = dict[str, str]
Qrels = dict[str, dict[str, int]]


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; bad JSON raises with the line number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"{path}:{lineno}: invalid JSON ({e.msg})", "each line must be one JSON object") from e
            if not isinstance(obj, dict):
                raise InvalidInputError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}", "each line must be one JSON object")
            yield lineno, obj


def _required_str(obj: dict[str, Any], key: str, path: Path, lineno: int) -> str:
    value = obj.get(key)
    if key == "_id" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # some BEIR sets use numeric ids; qrels compare them as strings
    if not isinstance(value, str) or (key == "_id" and not value):
        raise InvalidInputError(f"{path}:{lineno}: field {key!r} missing or not a string", f"every line needs a string {key!r}")
    return value


def read_corpus(path: Path) -> Corpus:
    """``corpus.jsonl`` -> ``{doc_id: (text, metadata)}``; a non-empty title is put in metadata["title"]."""
    corpus: Corpus = {}
    for lineno, obj in iter_jsonl(path):
        doc_id = _required_str(obj, "_id", path, lineno)
        text = _required_str(obj, "text", path, lineno)
        if doc_id in corpus:
            raise InvalidInputError(f"{path}:{lineno}: duplicate _id {doc_id!r}", "document ids must be unique")
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict):
            raise InvalidInputError(f"{path}:{lineno}: 'metadata' must be an object", "use {} or leave it out")
        meta = dict(meta)
        title = obj.get("title")
        if isinstance(title, str) and title:
            meta["title"] = title
        corpus[doc_id] = (text, meta)
    return corpus


def read_queries(path: Path) -> Queries:
    """A queries jsonl file -> ``{query_id: text}``."""
    queries: Queries = {}
    for lineno, obj in iter_jsonl(path):
        qid = _required_str(obj, "_id", path, lineno)
        if qid in queries:
            raise InvalidInputError(f"{path}:{lineno}: duplicate _id {qid!r}", "query ids must be unique")
        queries[qid] = _required_str(obj, "text", path, lineno)
    return queries


def read_qrels(path: Path) -> Qrels:
    """A BEIR qrels tsv -> ``{query_id: {doc_id: score}}``; the header line is optional."""
    qrels: Qrels = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.rstrip("\r\n").split("\t")
            if lineno == 1 and tuple(p.strip() for p in parts[:3]) == QRELS_HEADER:
                continue
            if len(parts) != 3:
                raise InvalidInputError(
                    f"{path}:{lineno}: expected 3 tab-separated columns, got {len(parts)}", "columns: query-id, corpus-id, score"
                )
            qid, doc_id, score_s = (p.strip() for p in parts)
            try:
                score = int(score_s)
            except ValueError:
                raise InvalidInputError(f"{path}:{lineno}: score {score_s!r} is not an integer", "scores are graded integers (0, 1, 2, ...)") from None
            qrels.setdefault(qid, {})[doc_id] = score
    return qrels


def available_languages(directory: Path) -> list[str]:
    """Languages with a ``queries-<lang>.jsonl`` file in ``directory``."""
    return sorted(p.name[len("queries-") : -len(".jsonl")] for p in Path(directory).glob("queries-*.jsonl"))


def load_beir(
    directory: Path, lang: str | None = None, *, split: str = "test", strict: bool = True
) -> tuple[Corpus, Queries, Qrels]:
    """Load a BEIR dataset: ``(corpus, queries, qrels)``.

    ``corpus``: ``{doc_id: (text, metadata)}`` (a non-empty ``title`` is in ``metadata["title"]``,
    not prepended to the text: callers decide whether to embed it). ``queries``: ``{qid: text}``,
    only the queries that have qrels in ``split`` (as BEIR's own loader does). ``qrels``:
    ``{qid: {doc_id: score}}``.

    ``lang`` picks ``queries-<lang>.jsonl`` + ``qrels/<split>-<lang>.tsv``; ``None`` reads the
    standard ``queries.jsonl`` + ``qrels/<split>.tsv`` (or, if those are absent, English).
    With ``strict`` (the default) a qrels row naming an unknown query or document raises
    :class:`InvalidInputError`; otherwise such rows are dropped.
    """
    directory = Path(directory)
    corpus_path = directory / "corpus.jsonl"
    if not corpus_path.is_file():
        raise NotFoundError(f"no corpus.jsonl in {directory}", "point at a BEIR dataset directory (e.g. one built by 'qswap bench data debian')")
    langs = available_languages(directory)
    standard = (directory / "queries.jsonl", directory / "qrels" / f"{split}.tsv")
    if lang is None and not standard[0].is_file() and "en" in langs:
        lang = "en"
    if lang is None:
        queries_path, qrels_path = standard
    else:
        queries_path, qrels_path = directory / f"queries-{lang}.jsonl", directory / "qrels" / f"{split}-{lang}.tsv"
    if not queries_path.is_file():
        found = ", ".join(langs) if langs else ("none: standard layout, pass lang=None" if standard[0].is_file() else "none")
        raise NotFoundError(f"no {queries_path.name} in {directory}", f"languages available: {found}")
    if not qrels_path.is_file():
        raise NotFoundError(f"no qrels/{qrels_path.name} in {directory}", f"the split {split!r} does not exist for this dataset")

    corpus = read_corpus(corpus_path)
    all_queries = read_queries(queries_path)
    raw_qrels = read_qrels(qrels_path)
    qrels: Qrels = {}
    for qid, rels in raw_qrels.items():
        if qid not in all_queries:
            if strict:
                raise InvalidInputError(f"{qrels_path}: query {qid!r} is not in {queries_path.name}", "pass strict=False to drop such rows")
            continue
        kept = {}
        for doc_id, score in rels.items():
            if doc_id not in corpus:
                if strict:
                    raise InvalidInputError(f"{qrels_path}: document {doc_id!r} (query {qid!r}) is not in corpus.jsonl", "pass strict=False to drop such rows")
                continue
            kept[doc_id] = score
        if kept:
            qrels[qid] = kept
    queries = {qid: all_queries[qid] for qid in qrels}
    return corpus, queries, qrels


def jsonl_line(obj: dict[str, Any]) -> str:
    """One compact, key-ordered JSON line (UTF-8 kept readable)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON lines (the caller makes the enclosing directory atomic); returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(jsonl_line(row))
            n += 1
    return n


def write_qrels(path: Path, rows: Iterable[tuple[str, str, int]]) -> int:
    """Write a BEIR qrels tsv with its header; returns the number of rows."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        f.write("\t".join(QRELS_HEADER) + "\n")
        for qid, doc_id, score in rows:
            f.write(f"{qid}\t{doc_id}\t{score}\n")
            n += 1
    return n
