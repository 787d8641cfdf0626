"""Captured feedback as a BEIR directory: what tuning trains on and sentinels are made from.

Per distinct query text (one query id, stable across exports: a hash of the text):

- clicked documents are relevant (grade 1; graded feedback keeps its grades);
- documents shown *above* the lowest click and not clicked are judged non-relevant (grade 0):
  the cascade assumption (a user examines the list top down), the click-model negatives that
  :meth:`qswap.tuning.data.BeirData.samples` turns into a training query's negatives;
- a query never clicked gives no judgement (a skip below every click says nothing).

Everything goes to ``qrels/test.tsv``, the split ``qswap tune run --beir`` and ``qswap
sentinels make --beir`` read, so the export is used like any BEIR set: the tune run splits it
into train / validation / test and records the query ids it trained on (``seen_queries.json``),
and ``qswap sentinels make --exclude-qids`` keeps those out of a sentinel made from the same
export.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from qswap.atomic import replace_dir
from qswap.beir import write_jsonl, write_qrels
from qswap.errors import InvalidInputError
from qswap.feedback.store import Feedback, Impression


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote."""

    queries: int
    documents: int
    positives: int
    negatives: int
    impressions: int


def query_id(text: str) -> str:
    """A stable id for a query text (whitespace and case folded)."""
    norm = " ".join(text.split()).casefold()
    return "fb-" + hashlib.sha256(norm.encode()).hexdigest()[:16]


def judgements(imp: Impression, fb: Feedback) -> dict[str, int]:
    """Graded judgements of one impression's documents under the cascade assumption."""
    if fb.grades:
        return {d: int(g) for d, g in fb.grades.items()}
    clicked = set(fb.clicks)
    if not clicked:
        return {}
    last = max(imp.ids.index(d) for d in clicked if d in imp.ids)
    out = {d: 0 for d in imp.ids[:last] if d not in clicked}
    out.update({d: 1 for d in clicked})
    return out


def export_beir(labelled: Iterable[tuple[Impression, Feedback]], out: Path,
                texts_of: Callable[[list[str]], dict[str, str]]) -> ExportSummary:
    """Write captured feedback as a BEIR directory (atomically: a finished export or none).

    Args:
        labelled: impressions with their feedback (:meth:`FeedbackStore.labelled`).
        out: the BEIR directory to write (replaced when it exists).
        texts_of: document texts by id (from the served index); ids it lacks are dropped.

    Returns:
        Counts of what was written.
    """
    queries: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    n_imp = 0
    for imp, fb in labelled:
        n_imp += 1
        j = judgements(imp, fb)
        if not j:
            continue
        qid = query_id(imp.query)
        queries.setdefault(qid, imp.query)
        cur = qrels.setdefault(qid, {})
        for d, g in j.items():   # a document ever judged relevant stays relevant
            cur[d] = max(cur.get(d, g), g)
    qrels = {q: r for q, r in qrels.items() if any(g > 0 for g in r.values())}
    if not qrels:
        raise InvalidInputError(f"no clicked or graded search among {n_imp} captured impressions",
                                "capture more traffic with feedback (POST /v1/feedback) first")
    doc_ids = sorted({d for r in qrels.values() for d in r})
    texts = texts_of(doc_ids)
    qrels = {q: {d: g for d, g in r.items() if d in texts} for q, r in qrels.items()}
    qrels = {q: r for q, r in qrels.items() if any(g > 0 for g in r.values())}
    out = Path(out)
    staging = out.with_name(f".{out.name}.staging")
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "qrels").mkdir(parents=True)
    used = sorted({d for r in qrels.values() for d in r})
    write_jsonl(staging / "corpus.jsonl", ({"_id": d, "title": "", "text": texts[d]} for d in used))
    write_jsonl(staging / "queries.jsonl", ({"_id": q, "text": queries[q]} for q in sorted(qrels)))
    write_qrels(staging / "qrels" / "test.tsv", ((q, d, g) for q in sorted(qrels) for d, g in sorted(qrels[q].items())))
    replace_dir(staging, out)
    grades = [g for r in qrels.values() for g in r.values()]
    return ExportSummary(queries=len(qrels), documents=len(used), positives=sum(g > 0 for g in grades),
                         negatives=sum(g == 0 for g in grades), impressions=n_imp)
