"""The data of ``qswap bench domains``: domains from Debian sections, one corpus, disjoint splits.

A **domain** is a Debian section (``metadata.section`` of a query in the Debian BEIR set:
the section of the package the one-line synopsis describes). Sections differ in what users
ask ("molecular dynamics simulation package" in science, "DHCP relay agent" in net, "backup
tool for LVM snapshots" in admin), and the large ones hold over a thousand judged English
queries, so a domain can give 1,000 training queries and keep a held-out set.

The corpus is every document relevant to a query the benchmark uses (held out or trained
on), and random other documents of the Debian set as distractors up to ``--docs``: one index
serves every domain, and a domain's queries compete with all of it.

Splits, per domain, seeded: the English queries are shuffled; the first ``held_out`` are
held out (evaluation and the server's sentinels, in every language: query ids are shared
across languages), the rest is the training pool, whose prefixes are the training sets of
the learning curve (100 within 300 within 1,000); queries beyond the largest size are not
used. Nothing held out is ever trained on.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from qswap.beir import read_corpus, read_qrels, read_queries, write_jsonl, write_qrels
from qswap.errors import InvalidInputError

Qrels = dict[str, dict[str, int]]


@dataclass
class Domain:
    """One domain: its held-out and training-pool English query ids (disjoint)."""

    name: str
    held_out: list[str]
    pool: list[str]

    def train(self, n: int) -> list[str]:
        """The first ``n`` queries of the training pool (nested across sizes)."""
        return self.pool[:n]


@dataclass
class DomainData:
    """What the benchmark runs on: the corpus, queries and qrels per language, the domains."""

    corpus: dict[str, str]                       # doc id -> text (title already prepended)
    queries: dict[str, dict[str, str]]           # lang -> qid -> text
    qrels: dict[str, Qrels]                      # lang -> qid -> doc -> grade
    domains: list[Domain]
    sections: dict[str, int] = field(default_factory=dict)   # documents per section in the corpus
    distractors: int = 0

    def lang_queries(self, lang: str, qids: list[str]) -> list[str]:
        """The ids of ``qids`` that have a judged query in ``lang``."""
        q, r = self.queries[lang], self.qrels[lang]
        return [x for x in qids if x in q and x in r]


def query_sections(beir: Path, lang: str = "en") -> dict[str, str]:
    """Section of each query (``metadata.section`` of ``queries-<lang>.jsonl``)."""
    path = Path(beir) / f"queries-{lang}.jsonl"
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                out[obj["_id"]] = (obj.get("metadata") or {}).get("section", "")
    return out


def _doc_sections(beir: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(Path(beir) / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                out[obj["_id"]] = (obj.get("metadata") or {}).get("section", "")
    return out


def load_domains(beir: Path, names: list[str], langs: list[str], *, held_out: int, max_train: int,
                 docs: int, seed: int = 0) -> DomainData:
    """Choose the corpus and split each domain's judged English queries (see the module doc).

    Raises :class:`InvalidInputError` when a domain has fewer than ``held_out + max_train``
    judged queries, so the learning curve's largest size is never silently cut.
    """
    sections = query_sections(beir, "en")
    doc_sec = _doc_sections(beir)
    qrels = {lang: read_qrels(beir, lang) for lang in langs}
    queries = {lang: read_queries(beir, lang) for lang in langs}
    qids = {n: sorted(q for q, s in sections.items() if s == n and q in qrels["en"] and q in queries["en"])
            for n in names}
    for n in names:
        if len(qids[n]) < held_out + max_train:
            raise InvalidInputError(f"domain {n!r} has {len(qids[n])} judged English queries, fewer than "
                                    f"{held_out} held out + {max_train} training",
                                    "choose larger sections, fewer --held-out or smaller --sizes")
    domains = []
    for n in names:
        ids = list(qids[n])
        random.Random(f"{seed}-{n}").shuffle(ids)
        # Only the queries used (held out + the largest training set): their answers are the
        # corpus's core, the rest of the corpus is distractors.
        domains.append(Domain(n, ids[:held_out], ids[held_out:held_out + max_train]))
    all_q = {q for d in domains for q in d.held_out + d.pool}
    keep = {doc for q in all_q for doc in qrels["en"][q]}
    others = sorted(set(doc_sec) - keep)
    extra = random.Random(seed).sample(others, max(0, min(len(others), docs - len(keep))))
    keep |= set(extra)
    full = read_corpus(beir)
    corpus = {d: full[d].text for d in sorted(keep)}
    queries = {lang: {q: t for q, t in queries[lang].items() if q in all_q} for lang in langs}
    qrels = {lang: {q: {d: g for d, g in r.items() if d in keep} for q, r in qrels[lang].items() if q in all_q}
             for lang in langs}
    sec_counts: dict[str, int] = {}
    for d in keep:
        sec_counts[doc_sec[d]] = sec_counts.get(doc_sec[d], 0) + 1
    return DomainData(corpus, queries, qrels, domains, dict(sorted(sec_counts.items(), key=lambda kv: -kv[1])),
                      len(extra))


def write_corpus(data: DomainData, path: Path) -> Path:
    """The corpus as a BEIR ``corpus.jsonl`` (what ``qswap index build`` embeds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, ({"_id": d, "title": "", "text": t} for d, t in data.corpus.items()))
    return path


def write_subset(data: DomainData, corpus: Path, out: Path, qids: list[str], langs: list[str]) -> Path:
    """A BEIR folder of ``qids`` only (in each language that has them) over the shared corpus
    (a symbolic link): what ``qswap tune run --beir`` and ``qswap sentinels make`` read."""
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    link = out / "corpus.jsonl"
    if not link.exists():
        os.symlink(corpus.resolve(), link)
    for lang in langs:
        ids = data.lang_queries(lang, qids)
        write_jsonl(out / f"queries-{lang}.jsonl", ({"_id": q, "text": data.queries[lang][q]} for q in ids))
        write_qrels(out / "qrels" / f"test-{lang}.tsv",
                    ((q, d, g) for q in ids for d, g in data.qrels[lang][q].items()))
    return out
