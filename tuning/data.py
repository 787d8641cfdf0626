"""Training and evaluation data: triplets JSONL, BEIR directories as samples, seeded splits.

Triplets use the sentence-transformers embedding-training-data format, one JSON object a
line: ``{"query": str, "pos": [str, ...], "neg": [str, ...]}`` (``neg`` may be absent when
negatives are mined). BEIR directories are read by :mod:`qswap.beir` (layouts, languages,
gzip); :func:`read_beir` turns one into :class:`BeirData`. Every problem is reported as
``file:line: what`` in a named qswap error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from qswap.beir import LineErrors, iter_jsonl, load_beir
from qswap.errors import InvalidInputError


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
    """A BEIR corpus (ids and the texts to embed), the queries with a judgement and their qrels."""

    corpus_ids: list[str]
    corpus_texts: list[str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    source: str = ""

    def samples(self) -> list[Sample]:
        """One sample per query that has a relevant document in the corpus (grade > 0).

        Documents judged non-relevant (grade 0: e.g. skipped above a click in captured feedback)
        are the sample's negatives; a sample without any gets mined ones.
        """
        text_of = dict(zip(self.corpus_ids, self.corpus_texts))
        out = []
        for qid, query in self.queries.items():
            judged = self.qrels.get(qid, {})
            rel = [d for d, g in judged.items() if g > 0 and d in text_of]
            non = [d for d, g in judged.items() if g <= 0 and d in text_of]
            if rel:
                out.append(Sample(query=query, positives=[text_of[d] for d in rel], qid=qid,
                                  negatives=[text_of[d] for d in non], positive_ids=rel, negative_ids=non,
                                  where=f"{self.source} query {qid}"))
        return out


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
    problems = LineErrors(path)
    out: list[Sample] = []
    for no, obj in iter_jsonl(path, problems):
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


def read_beir(directory: Path, lang: str | None = None, split: str = "test",
              corpus_lang: str | None = None) -> BeirData:
    """A BEIR directory as tuning data, read by :func:`qswap.beir.load_beir`.

    Queries and qrels in ``lang``, corpus in ``corpus_lang`` (default ``lang``); documents are
    embedded as the index embeds them (:func:`qswap.beir.document_text`: title + text). Not
    strict: qrels rows naming an unknown query or document are dropped (:meth:`BeirData.samples`
    could not use them anyway).
    """
    directory = Path(directory)
    corpus, queries, qrels = load_beir(directory, lang, split=split, strict=False, corpus_lang=corpus_lang)
    return BeirData(list(corpus), [doc.text for doc in corpus.values()], queries, qrels,
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
