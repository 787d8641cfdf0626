"""Corpus readers: JSONL (``{"id", "text", ...metadata}``) and BEIR (``corpus.jsonl`` rows
``{"_id", "title", "text", "metadata"}``), streamed line by line.

Every bad line (not UTF-8, not JSON, not an object, no id or text, a duplicate id) is
reported with its line number. ``on_bad_line="stop"`` raises at the first one;
``"skip"`` leaves it out, logs it and records it in ``bad_lines``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qswap.beir import document_text
from qswap.errors import InvalidInputError, NotFoundError

log = logging.getLogger("qswap.index")

FORMATS = ("auto", "jsonl", "beir")
BAD_LINE_MODES = ("stop", "skip")
# Individual warnings logged per file before they are only counted.
_MAX_LOGGED = 20


@dataclass
class Document:
    """One document: external id, text returned with hits, and free-form JSON metadata."""

    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadLine:
    """A corpus line left out: 1-based line number and why."""

    line: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "reason": self.reason}


@dataclass
class CorpusRecord:
    """A parsed line: the document and the text to embed (BEIR puts the title first)."""

    line: int
    doc: Document
    embed_text: str


def corpus_file(path: Path) -> Path:
    """The JSONL file behind ``path``: the file itself, or ``corpus.jsonl`` in a BEIR folder."""
    path = Path(path)
    if path.is_dir():
        f = path / "corpus.jsonl"
        if not f.is_file():
            raise NotFoundError(f"{path} is a folder without corpus.jsonl",
                                "pass a JSONL file, or a BEIR dataset folder holding corpus.jsonl")
        return f
    if not path.is_file():
        raise NotFoundError(f"corpus {path} does not exist", "check the path")
    return path


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _parse(raw: bytes, lineno: int, fmt: str) -> tuple[str, Document, str]:
    """Parse one line; returns (format used, document, embed text) or raises ValueError(reason)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if lineno == 1 and s.startswith("\ufeff"):
        s = s[1:]
    try:
        obj = json.loads(s, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__} where an object was expected")
    if fmt == "auto":
        fmt = "beir" if "_id" in obj and "id" not in obj else "jsonl"
    key = "_id" if fmt == "beir" else "id"
    if key not in obj:
        raise ValueError(f'no "{key}" field')
    raw_id = obj[key]
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise ValueError(f'"{key}" must be a string or an integer, got {type(raw_id).__name__}')
    doc_id = str(raw_id)
    if not doc_id.strip():
        raise ValueError(f'"{key}" is empty')
    if "text" not in obj:
        raise ValueError('no "text" field')
    text = obj["text"]
    if not isinstance(text, str):
        raise ValueError(f'"text" must be a string, got {type(text).__name__}')
    meta: dict[str, Any] = {}
    nested = obj.get("metadata")
    if isinstance(nested, dict):
        meta.update(nested)
    for k, v in obj.items():
        if k in (key, "text") or (k == "metadata" and isinstance(v, dict)):
            continue
        meta[k] = v
    embed_text = text
    if fmt == "beir":
        title = obj.get("title")
        if title is not None and not isinstance(title, str):
            raise ValueError(f'"title" must be a string, got {type(title).__name__}')
        # The project's one title rule, shared with tuning (qswap.beir.document_text).
        embed_text = document_text(title, text)
    return fmt, Document(doc_id, text, meta), embed_text


def iter_corpus(
    path: Path,
    *,
    format: str = "auto",
    on_bad_line: str = "stop",
    bad_lines: list[BadLine] | None = None,
    known_ids: dict[str, int] | None = None,
) -> Iterator[CorpusRecord]:
    """Yield the corpus's documents in file order.

    ``bad_lines`` (if given) collects the lines skipped; ``known_ids`` maps ids already seen
    to their line and is filled as the file is read (duplicates are bad lines).
    """
    if format not in FORMATS:
        raise InvalidInputError(f"unknown corpus format {format!r}", f"use one of {', '.join(FORMATS)}")
    if on_bad_line not in BAD_LINE_MODES:
        raise InvalidInputError(f"unknown on_bad_line {on_bad_line!r}", "use 'stop' or 'skip'")
    f = corpus_file(path)
    seen = known_ids if known_ids is not None else {}
    fmt = format
    logged = 0
    with open(f, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                fmt_used, doc, embed_text = _parse(raw, lineno, fmt)
                _require_encodable(doc, embed_text)
                first = seen.get(doc.id)
                if first is not None:
                    raise ValueError(f"duplicate id {doc.id!r} (first on line {first})")
            except ValueError as e:
                reason = str(e)
                if on_bad_line == "stop":
                    raise InvalidInputError(
                        f"{f}, line {lineno}: {reason}",
                        "fix or remove that line, or rerun with --on-bad-line skip to leave bad lines out",
                    ) from None
                if bad_lines is not None:
                    bad_lines.append(BadLine(lineno, reason))
                if logged < _MAX_LOGGED:
                    log.warning("%s, line %d skipped: %s", f, lineno, reason)
                    logged += 1
                continue
            fmt = fmt_used
            seen[doc.id] = lineno
            yield CorpusRecord(lineno, doc, embed_text)


def read_corpus(path: Path, *, format: str = "auto", on_bad_line: str = "stop"
                ) -> tuple[list[CorpusRecord], list[BadLine]]:
    """All records of a (small) corpus plus the bad lines skipped."""
    bad: list[BadLine] = []
    records = list(iter_corpus(path, format=format, on_bad_line=on_bad_line, bad_lines=bad))
    return records, bad


def check_documents(docs: list[Document]) -> None:
    """Validate documents given through the API (not a file): ids, text, JSON metadata."""
    seen: set[str] = set()
    for i, d in enumerate(docs):
        if not isinstance(d, Document):
            raise InvalidInputError(f"document {i} is a {type(d).__name__}, not a Document",
                                    "pass qswap.index.Document(id, text, metadata)")
        if not isinstance(d.id, str) or not d.id.strip():
            raise InvalidInputError(f"document {i} has an empty or non-string id {d.id!r}",
                                    "give every document a non-empty string id")
        if d.id in seen:
            raise InvalidInputError(f"duplicate id {d.id!r} in one batch (document {i})",
                                    "send each id once per call")
        seen.add(d.id)
        if not isinstance(d.text, str):
            raise InvalidInputError(f"document {d.id!r}: text must be a string",
                                    "pass the document text as str")
        if not isinstance(d.metadata, dict):
            raise InvalidInputError(f"document {d.id!r}: metadata must be a dict",
                                    "pass metadata as a JSON object")
        try:
            json.dumps(d.metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"document {d.id!r}: metadata is not JSON-serialisable ({e})",
                                    "use only strings, numbers, booleans, null, lists and objects") from None
        require_utf8(d.id, f"document {i}: id")
        require_utf8(d.text, f"document {d.id!r}: text")
        require_utf8(json.dumps(d.metadata, ensure_ascii=False), f"document {d.id!r}: metadata")


def _require_encodable(doc: Document, embed_text: str) -> None:
    """A corpus line whose JSON escapes decode to a lone surrogate is a bad line (ValueError)."""
    try:
        for v in (doc.id, doc.text, embed_text, json.dumps(doc.metadata, ensure_ascii=False)):
            v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds an escaped lone surrogate (e.g. \\udc00), which is not valid Unicode") from None


def require_utf8(value: str, what: str) -> None:
    """Refuse a string UTF-8 cannot encode (a lone surrogate such as ``\\udc00``): the
    document store, the hashes and every client speak UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"{what} holds a character that is not valid Unicode "
                                f"({value[e.start:e.end]!a} at position {e.start})",
                                "send valid UTF-8 text (lone surrogates cannot be stored)") from None
