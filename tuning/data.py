"""Training and evaluation data: triplets JSONL, BEIR directories, seeded splits.

Triplets use the sentence-transformers embedding-training-data format, one JSON object a
line: ``{"query": str, "pos": [str, ...], "neg": [str, ...]}`` (``neg`` may be absent when
negatives are mined). BEIR directories hold ``corpus.jsonl`` (``_id``, ``title``,
``text``), ``queries.jsonl`` (``_id``, ``text``) and ``qrels/<split>.tsv``; a
multilingual directory has per-language files ``queries-<lang>.jsonl``,
``corpus-<lang>.jsonl`` and ``qrels/<split>-<lang>.tsv`` (each falls back to the plain
name). Every problem is reported as ``file:line: what`` in a named qswap error.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np

from qswap.errors import InvalidInputError, NotFoundError

_MAX_REPORTED = 5


@dataclass
class Sample:
    """One query with its positive and negative documents (texts; ids when known)."""

    query: str
    positives: list[str]
    negatives: list[str] = field(default_factory=list)
    qid: str | None = None
    positive_ids: list[str] | None = None
    negative_ids: list[str] | None = None
    where: str = ""          # "file:line" of its origin, for messages


@dataclass
class Splits:
    """Disjoint train / validation / test lists of samples."""

    train: list[Sample]
    validation: list[Sample]
    test: list[Sample]

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "validation": len(self.validation), "test": len(self.test)}


@dataclass
class BeirData:
    """A BEIR corpus, queries and qrels for one language (or the plain files)."""

    corpus_ids: list[str]
    corpus_texts: list[str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    source: str = ""

    def samples(self) -> list[Sample]:
        """One sample per query that has a relevant document in the corpus (grade > 0)."""
        text_of = dict(zip(self.corpus_ids, self.corpus_texts))
        out = []
        for qid, query in self.queries.items():
            rel = [d for d, g in self.qrels.get(qid, {}).items() if g > 0 and d in text_of]
            if rel:
                out.append(Sample(query=query, positives=[text_of[d] for d in rel], qid=qid,
                                  positive_ids=rel, negative_ids=[], where=f"{self.source} query {qid}"))
        return out


class _Problems:
    """Collects bad lines so one error names several of them at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[str] = []
        self.count = 0

    def add(self, line: int, what: str) -> None:
        self.count += 1
        if len(self.items) < _MAX_REPORTED:
            self.items.append(f"{self.path.name}:{line}: {what}")

    def raise_if_any(self, hint: str) -> None:
        if self.count:
            more = f" (and {self.count - len(self.items)} more)" if self.count > len(self.items) else ""
            raise InvalidInputError(f"{self.count} bad line(s) in {self.path}: " + "; ".join(self.items) + more, hint)


def _open_text(path: Path) -> IO[str]:
    if not path.exists():
        raise NotFoundError(f"data file {path} does not exist", "check the path")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _json_lines(path: Path, problems: _Problems) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; bad JSON is recorded, not yielded."""
    seen = False
    with _open_text(path) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            seen = True
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.add(no, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                problems.add(no, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield no, obj
    if not seen:
        raise InvalidInputError(f"{path} is empty", "give a JSONL file with one JSON object per line")


def _text_list(obj: dict, key: str) -> list[str] | str:
    """The list of non-empty strings under ``key``, or a problem description."""
    v = obj[key]
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        return f"field {key!r} must be a list of strings"
    if any(not isinstance(t, str) or not t.strip() for t in v):
        return f"field {key!r} holds an empty or non-string entry"
    return v


def read_triplets(path: Path, require_negatives: bool = False) -> list[Sample]:
    """Read ``{"query", "pos", "neg"}`` lines; every bad line is reported with its number.

    A query with no positive is an error; so is a missing ``neg`` when
    ``require_negatives`` (no negatives will be mined).
    """
    path = Path(path)
    problems = _Problems(path)
    out: list[Sample] = []
    for no, obj in _json_lines(path, problems):
        q = obj.get("query")
        if not isinstance(q, str) or not q.strip():
            problems.add(no, "missing field 'query'" if q is None else "field 'query' must be a non-empty string")
            continue
        if "pos" not in obj:
            problems.add(no, "missing field 'pos'")
            continue
        pos = _text_list(obj, "pos")
        if isinstance(pos, str):
            problems.add(no, pos)
            continue
        if not pos:
            problems.add(no, "query has no positive ('pos' is empty)")
            continue
        neg: list[str] | str = []
        if "neg" in obj:
            neg = _text_list(obj, "neg")
            if isinstance(neg, str):
                problems.add(no, neg)
                continue
        if require_negatives and not neg:
            problems.add(no, "query has no negative ('neg' missing or empty)")
            continue
        out.append(Sample(query=q, positives=pos, negatives=neg, where=f"{path.name}:{no}"))
    problems.raise_if_any('each line must be {"query": str, "pos": [str, ...], "neg": [str, ...]}'
                          + ("; or mine negatives (--mine corpus / --mine index)" if require_negatives else ""))
    return out


def _lang_file(directory: Path, stem: str, suffix: str, lang: str | None) -> Path:
    if lang:
        p = directory / f"{stem}-{lang}{suffix}"
        if p.exists():
            return p
    p = directory / f"{stem}{suffix}"
    if not p.exists():
        want = f"{stem}-{lang}{suffix} or {stem}{suffix}" if lang else f"{stem}{suffix}"
        raise NotFoundError(f"BEIR directory {directory} has no {want}",
                            "point at a BEIR directory (corpus.jsonl, queries.jsonl, qrels/)")
    return p


def read_beir_corpus(directory: Path, lang: str | None = None,
                     with_title: bool = False) -> tuple[list[str], list[str]]:
    """(ids, texts) of a BEIR corpus. The text alone by default (as ``qswap.bench`` embeds
    it); ``with_title`` embeds ``title + " " + text`` (the BEIR convention)."""
    path = _lang_file(Path(directory), "corpus", ".jsonl", lang)
    problems = _Problems(path)
    ids, texts = [], []
    for no, obj in _json_lines(path, problems):
        did, text, title = obj.get("_id"), obj.get("text"), obj.get("title") or ""
        if did is None or not isinstance(text, str):
            problems.add(no, "missing field '_id'" if did is None else "missing field 'text'")
            continue
        full = f"{title} {text}".strip() if with_title and isinstance(title, str) and title else text
        if not full.strip():
            problems.add(no, "empty document")
            continue
        ids.append(str(did))
        texts.append(full)
    problems.raise_if_any('corpus lines must be {"_id": str, "title": str, "text": str}')
    return ids, texts


def read_beir_queries(directory: Path, lang: str | None = None) -> dict[str, str]:
    """Query id -> text of a BEIR queries file."""
    path = _lang_file(Path(directory), "queries", ".jsonl", lang)
    problems = _Problems(path)
    out: dict[str, str] = {}
    for no, obj in _json_lines(path, problems):
        qid, text = obj.get("_id"), obj.get("text")
        if qid is None or not isinstance(text, str) or not text.strip():
            problems.add(no, "missing field '_id'" if qid is None else "missing or empty field 'text'")
            continue
        out[str(qid)] = text
    problems.raise_if_any('query lines must be {"_id": str, "text": str}')
    return out


def read_beir_qrels(directory: Path, lang: str | None = None, split: str = "test") -> dict[str, dict[str, int]]:
    """Query id -> {document id: grade} from ``qrels/<split>[-<lang>].tsv`` (header optional)."""
    path = _lang_file(Path(directory) / "qrels", split, ".tsv", lang)
    problems = _Problems(path)
    out: dict[str, dict[str, int]] = {}
    with _open_text(path) as f:
        for no, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if not line.strip() or (no == 1 and parts[0] in ("query-id", "qid", "query_id")):
                continue
            if len(parts) < 3:
                problems.add(no, f"expected 3 tab-separated columns, got {len(parts)}")
                continue
            try:
                grade = int(float(parts[2]))
            except ValueError:
                problems.add(no, f"score {parts[2]!r} is not a number")
                continue
            out.setdefault(parts[0], {})[parts[1]] = grade
    problems.raise_if_any("qrels lines are 'query-id<TAB>corpus-id<TAB>score'")
    if not out:
        raise InvalidInputError(f"{path} has no judgements", "give at least one query-id/corpus-id/score line")
    return out


def read_beir(directory: Path, lang: str | None = None, split: str = "test",
              corpus_lang: str | None = None, with_title: bool = False) -> BeirData:
    """Read a BEIR directory: queries and qrels in ``lang``, corpus in ``corpus_lang`` (default ``lang``)."""
    directory = Path(directory)
    ids, texts = read_beir_corpus(directory, corpus_lang or lang, with_title)
    return BeirData(ids, texts, read_beir_queries(directory, lang), read_beir_qrels(directory, lang, split),
                    source=f"{directory.name}[{lang or '-'}]")


def _count(spec: float, n: int, what: str) -> int:
    if spec < 0:
        raise InvalidInputError(f"{what} size must be >= 0, got {spec}", "give a fraction (< 1) or a count")
    return int(round(spec * n)) if spec < 1 else int(spec)


def split_samples(samples: Sequence[Sample], validation: float = 0.1, test: float = 0.1,
                  seed: int = 0) -> Splits:
    """Shuffle with ``seed`` and cut off validation and test sets.

    Sizes below 1 are fractions, otherwise counts. The same seed and input order give the
    same split.
    """
    n = len(samples)
    n_val, n_test = _count(validation, n, "validation"), _count(test, n, "test")
    if n_val + n_test >= n:
        raise InvalidInputError(f"{n} samples cannot give {n_val} validation + {n_test} test and "
                                "leave any for training", "use more data or smaller splits")
    order = np.random.default_rng(seed).permutation(n)
    shuffled = [samples[i] for i in order]
    return Splits(train=shuffled[n_val + n_test:], validation=shuffled[:n_val],
                  test=shuffled[n_val:n_val + n_test])
