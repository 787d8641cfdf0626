"""Base vs tuned query encoder on BEIR directories, any query language x document language.

One :class:`BeirEvaluator` per run memoises what several reports share: corpora (embedded
once through the document cache, or taken from an index's stored embeddings) and query
embeddings of both encoders, so the language matrix, the guard's sentinels and the test
evaluation never embed twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np

from qswap.beir import read_corpus, read_qrels, read_queries
from qswap.encoders import BaseEncoder
from qswap.errors import InvalidInputError
from qswap.tuning.doc_cache import StoredEmbeddings, embed_documents
from qswap.guard.evaluation import RankingMetrics, compare_metrics, evaluate_retrieval
from qswap.tuning.progress import encode_with_progress

Encode = Callable[[list[str]], np.ndarray]


@dataclass
class PairResult:
    """Metrics of both encoders on one (query language, document language) pair."""

    query_lang: str | None
    doc_lang: str | None
    base: RankingMetrics
    tuned: RankingMetrics

    def comparison(self) -> dict[str, Any]:
        return compare_metrics(self.base, self.tuned)


class BeirEvaluator:
    """Evaluates ``encode_tuned`` against ``encode_base`` (default ``base.encode_queries``) on BEIR pairs."""

    def __init__(self, base: BaseEncoder, encode_tuned: Encode, cache_dir: Path | None = None,
                 progress: bool = True, stored: StoredEmbeddings | None = None,
                 encode_base: Encode | None = None) -> None:
        self.base, self.encode_tuned = base, encode_tuned
        self.encode_base = encode_base or base.encode_queries
        self.cache_dir, self.progress = cache_dir, progress
        self.stored = stored
        self._corpora: dict[tuple[str, str | None], tuple[dict[str, int], np.ndarray]] = {}
        self._queries: dict[tuple[str, str | None, str], dict[str, np.ndarray]] = {}

    def corpus(self, directory: Path, lang: str | None) -> tuple[dict[str, int], np.ndarray]:
        """(doc id -> row, embeddings) of ``corpus-<lang>.jsonl`` (or ``corpus.jsonl``)."""
        key = (str(Path(directory).resolve()), lang)
        if key not in self._corpora:
            corpus = read_corpus(directory, lang)   # title + text: the index's rule
            ids, texts = list(corpus), [doc.text for doc in corpus.values()]
            emb = embed_documents(self.base, texts, self.cache_dir, progress=self.progress,
                                  ids=list(ids), stored=self.stored)
            self._corpora[key] = ({d: i for i, d in enumerate(ids)}, emb)
        return self._corpora[key]

    def _encode(self, which: str, directory: Path, lang: str | None, qids: list[str],
                texts: list[str]) -> np.ndarray:
        """Query embeddings by one encoder, memoised per (directory, language, encoder, qid)."""
        memo = self._queries.setdefault((str(Path(directory).resolve()), lang, which), {})
        missing = [i for i, q in enumerate(qids) if q not in memo]
        if missing:
            enc = self.encode_base if which == "base" else self.encode_tuned
            emb = encode_with_progress(enc, [texts[i] for i in missing],
                                       f"encoding {lang or 'default'} queries ({which})", self.progress)
            for i, e in zip(missing, emb):
                memo[qids[i]] = e
        return np.stack([memo[q] for q in qids])

    def pair(self, directory: Path, query_lang: str | None, doc_lang: str | None = None,
             keep_qids: Collection[str] | None = None, exclude_qids: Collection[str] = (),
             ks: tuple[int, ...] = (10, 100)) -> PairResult:
        """Both encoders' metrics for queries in ``query_lang`` against the ``doc_lang`` corpus.

        ``keep_qids`` restricts to those queries (e.g. a test split); ``exclude_qids`` drops
        queries (e.g. ones trained on). Relevance comes from the query language's qrels.
        """
        directory = Path(directory)
        doc_rows, doc_emb = self.corpus(directory, doc_lang)
        queries = read_queries(directory, query_lang)
        qrels = read_qrels(directory, query_lang)
        keep = set(keep_qids) if keep_qids is not None else None
        excl = set(exclude_qids)
        qids, rel = [], []
        for qid in queries:
            if (keep is not None and qid not in keep) or qid in excl:
                continue
            r = {doc_rows[d]: g for d, g in qrels.get(qid, {}).items() if g > 0 and d in doc_rows}
            if r:
                qids.append(qid)
                rel.append(r)
        if not qids:
            raise InvalidInputError(f"{directory} [{query_lang}->{doc_lang}]: no query left with a relevant "
                                    "document in the corpus", "check the languages and the split")
        texts = [queries[q] for q in qids]
        base_m = evaluate_retrieval(self._encode("base", directory, query_lang, qids, texts), doc_emb, rel, ks)
        tuned_m = evaluate_retrieval(self._encode("tuned", directory, query_lang, qids, texts), doc_emb, rel, ks)
        return PairResult(query_lang, doc_lang, base_m, tuned_m)
