"""Sentinel sets, in both their forms, and ``qswap sentinels make``.

- **Tuning** (``qswap tune run --sentinel``): a :class:`TuneSentinel`, from a spec
  ``[NAME=]beir:DIR[:QLANG[-DLANG]]`` (a BEIR directory with its own corpus, embedded by the
  base) or ``[NAME=]triplets:FILE`` (:func:`parse_sentinel`).
- **Serving** (``qswap serve --sentinels``): an :class:`IndexSentinel` per folder below
  (:func:`load_sentinels`), made by ``qswap sentinels make`` from :class:`JudgedQueries`.

A sentinel is a folder ``OUT/<name>/`` in BEIR layout without a corpus (the corpus is the
served index): ``queries.jsonl``, ``qrels/test.tsv`` and ``sentinel.json`` (language, source,
seed, sizes). ``qswap serve --sentinels OUT`` evaluates every registered encoder on them.

Sources: a BEIR directory (queries in one language and their qrels) or labelled query logs
(JSONL ``{"query": str, "relevant": [doc id, ...] or {doc id: grade}, "id"?: str}``). A seeded
sample of ``n`` queries is drawn; with ``--index``, judgements on documents the index does
not hold are dropped (and queries left without any), so the sentinel fits the served index.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from qswap.atomic import atomic_write_json, staged_dir
from qswap.beir import LineErrors, iter_jsonl, load_beir, read_qrels, read_queries, write_jsonl, write_qrels
from qswap.errors import InvalidInputError, NotFoundError
from qswap.names import validate_name

META = "sentinel.json"
SENTINEL_FORMS = "beir:DIR[:QLANG[-DLANG]] or triplets:FILE, optionally prefixed NAME="


@dataclass
class JudgedQueries:
    """Judged queries before sampling: id -> text, id -> {doc id: grade > 0}."""

    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    source: str
    lang: str | None


@dataclass
class IndexSentinel:
    """One sentinel: judged queries whose relevant documents are in the served index."""

    name: str
    lang: str | None
    qids: list[str]
    texts: list[str]
    qrels: list[dict[str, int]]     # per query: index document id -> grade (> 0)

    def doc_ids(self) -> set[str]:
        return {d for r in self.qrels for d in r}


def load_sentinels(directory: Path) -> list[IndexSentinel]:
    """Every sentinel under ``directory`` (sorted by name); a bad one is a named error."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotFoundError(f"sentinels directory {directory} does not exist",
                            "build one with `qswap sentinels make`, or drop --sentinels")
    # ".name-*" are staging folders and "name.old" a swap interrupted by a crash (`sentinels make`).
    subs = sorted(p for p in directory.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".old"))
    if not subs:
        raise InvalidInputError(f"sentinels directory {directory} holds no sentinel folder",
                                "each sentinel is a folder with queries.jsonl and qrels/test.tsv "
                                "(`qswap sentinels make` writes them)")
    out = []
    for sub in subs:
        meta: dict[str, Any] = {}
        if (sub / META).is_file():
            try:
                meta = json.loads((sub / META).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidInputError(f"{sub / META} is not valid JSON ({e})",
                                        "rewrite it with `qswap sentinels make`") from None
        queries = read_queries(sub, None)
        qrels = read_qrels(sub, None)
        qids = [q for q in queries if any(g > 0 for g in qrels.get(q, {}).values())]
        if not qids:
            raise InvalidInputError(f"sentinel {sub.name}: no query has a relevant document in qrels/test.tsv",
                                    "check that qrels name the queries of queries.jsonl")
        out.append(IndexSentinel(sub.name, meta.get("lang") if isinstance(meta, dict) else None, qids,
                               [queries[q] for q in qids],
                               [{d: g for d, g in qrels[q].items() if g > 0} for q in qids]))
    return out


def sentinels_fingerprint(sentinels: list[IndexSentinel]) -> str:
    """sha256 of the sentinels' names, queries and judgements (a verdict names what it judged)."""
    h = hashlib.sha256()
    for s in sentinels:
        h.update(json.dumps([s.name, s.qids, s.texts, s.qrels], sort_keys=True).encode())
    return h.hexdigest()[:16]


def sentinel_coverage(sentinels: list[IndexSentinel], index_ids: set[str]) -> list[dict[str, Any]]:
    """How much of each sentinel the index still judges: per sentinel its name, its judged
    queries, the queries left with a relevant document in the index, and the judgements dropped.

    Args:
        sentinels: the loaded sentinel sets.
        index_ids: the document ids the served index holds.

    Returns:
        One ``{"name", "queries", "queries_left", "judgements_dropped"}`` per sentinel.
    """
    out = []
    for s in sentinels:
        left = sum(1 for r in s.qrels if any(d in index_ids for d in r))
        dropped = sum(1 for r in s.qrels for d in r if d not in index_ids)
        out.append({"name": s.name, "queries": len(s.qids), "queries_left": left, "judgements_dropped": dropped})
    return out


def from_beir(directory: Path, lang: str | None, split: str = "test") -> JudgedQueries:
    """Queries of ``lang`` that have a relevant document in the BEIR qrels."""
    corpus, queries, qrels = load_beir(directory, lang, split=split, strict=False)
    rel = {q: {d: g for d, g in r.items() if g > 0} for q, r in qrels.items()}
    rel = {q: r for q, r in rel.items() if r and q in queries}
    return JudgedQueries({q: queries[q] for q in queries if q in rel}, rel, f"beir:{directory}", lang)


def from_log(path: Path, lang: str | None = None) -> JudgedQueries:
    """Labelled query logs, one ``{"query", "relevant", "id"?}`` a line (ids default to ``log-<line>``)."""
    errors = LineErrors(path)
    queries: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    for no, obj in iter_jsonl(path, errors):
        q, rel = obj.get("query"), obj.get("relevant")
        qid = obj.get("id", f"log-{no}")
        if not isinstance(q, str) or not q.strip():
            errors.add(no, "field 'query' must be a non-empty string")
            continue
        if isinstance(rel, list) and rel and all(isinstance(d, str) and d for d in rel):
            grades = {d: 1 for d in rel}
        elif isinstance(rel, dict) and rel and all(isinstance(g, int) and not isinstance(g, bool)
                                                   for g in rel.values()):
            grades = {str(d): int(g) for d, g in rel.items() if g > 0}
        else:
            errors.add(no, "field 'relevant' must be a non-empty list of document ids or {id: grade}")
            continue
        if not isinstance(qid, (str, int)) or isinstance(qid, bool) or str(qid) in queries:
            errors.add(no, f"id {qid!r} is not a string or is repeated")
            continue
        if grades:
            queries[str(qid)] = q
            qrels[str(qid)] = grades
    errors.raise_if_any('log lines are {"query": str, "relevant": [doc id, ...] or {doc id: grade}, "id"?: str}')
    if not queries:
        raise InvalidInputError(f"{path} has no query with a relevant document", "label some queries")
    return JudgedQueries(queries, qrels, f"log:{path}", lang)


def make_sentinel(data: JudgedQueries, out: Path, name: str, n: int, seed: int = 0,
                  index_ids: Collection[str] | None = None,
                  exclude_qids: Collection[str] = ()) -> dict[str, Any]:
    """Sample ``n`` queries (seeded) into ``out/<name>/`` atomically; returns what ``sentinel.json`` holds."""
    validate_name(name, "sentinel name")
    if n < 1:
        raise InvalidInputError(f"sample size {n} must be at least 1", "give --n 1000, say")
    excluded = set(exclude_qids)
    qrels = {q: r for q, r in data.qrels.items() if q not in excluded}
    dropped_docs = 0
    if index_ids is not None:
        ids = set(index_ids)
        kept = {}
        for q, r in qrels.items():
            r2 = {d: g for d, g in r.items() if d in ids}
            dropped_docs += len(r) - len(r2)
            if r2:
                kept[q] = r2
        qrels = kept
    pool = sorted(qrels)
    if not pool:
        raise InvalidInputError(f"no judged query left for sentinel {name}",
                                "check that the qrels name documents of the index, and --exclude-qids")
    take = sorted(random.Random(seed).sample(pool, min(n, len(pool))))
    meta = {"name": name, "lang": data.lang, "source": data.source, "seed": seed, "requested": n,
            "queries": len(take), "available": len(pool), "excluded_queries": len(excluded & set(data.qrels)),
            "judgements_dropped_not_in_index": dropped_docs}
    with staged_dir(Path(out) / name) as staging:
        (staging / "qrels").mkdir()
        write_jsonl(staging / "queries.jsonl", [{"_id": q, "text": data.queries[q]} for q in take])
        write_qrels(staging / "qrels" / "test.tsv", [(q, d, g) for q in take for d, g in sorted(qrels[q].items())])
        atomic_write_json(staging / META, meta)
    return meta


def read_qid_file(path: Path) -> set[str]:
    """Query ids to leave out: one a line, a JSON list, or a tune run's ``training_queries.json``
    (``{"ids": [...]}``, the queries it trained and validated on)."""
    text = Path(path).read_text()
    if text.lstrip().startswith(("[", "{")):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"{path} is not JSON ({e})", "one id per line, or a JSON list") from None
        ids = obj.get("ids") if isinstance(obj, dict) else obj
        if not isinstance(ids, list):
            raise InvalidInputError(f"{path} holds no list of query ids",
                                    'one id per line, a JSON list, or {"ids": [...]}')
        return {str(x) for x in ids}
    return {ln.strip() for ln in text.splitlines() if ln.strip()}


@dataclass(frozen=True)
class TuneSentinel:
    """A sentinel set: a BEIR (query language, document language) pair or a triplets file."""

    name: str
    kind: str                   # "beir" | "triplets"
    path: Path
    query_lang: str | None = None
    doc_lang: str | None = None


def parse_sentinel(spec: str) -> TuneSentinel:
    """Parse ``[NAME=]beir:DIR[:QLANG[-DLANG]]`` or ``[NAME=]triplets:FILE``."""
    name = None
    if "=" in spec.split(":", 1)[0]:
        name, spec = spec.split("=", 1)
    kind, _, rest = spec.partition(":")
    if kind not in ("beir", "triplets") or not rest:
        raise InvalidInputError(f"bad sentinel {spec!r}", f"use {SENTINEL_FORMS}")
    if kind == "triplets":
        return TuneSentinel(name or f"triplets:{Path(rest).name}", kind, Path(rest))
    path, ql, dl = rest, None, None
    head, sep, tail = rest.rpartition(":")
    if sep and head and not Path(rest).exists():
        path, langs = head, tail
        ql, _, dl = langs.partition("-")
        ql, dl = ql or None, dl or None
    label = f"{ql or 'queries'}->{dl or 'corpus'}"
    return TuneSentinel(name or f"{Path(path).name}:{label}", kind, Path(path), ql, dl or None)
