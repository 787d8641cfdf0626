"""Preparing a tuning run's data: every document embedded once, negatives mined, the splits
turned into rows of one document table (training and evaluation only index into it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qswap.encoders.base import BaseEncoder
from qswap.errors import InvalidInputError
from qswap.tuning.config import RunConfig
from qswap.tuning.data import BeirData, Sample
from qswap.tuning.doc_cache import DocTable, StoredEmbeddings
from qswap.tuning.inputs import mining_source
from qswap.tuning.mining import mine_negatives
from qswap.tuning.queries import Encode
from qswap.tuning.trainer import EncodedSet


def _rows(table: DocTable, s: Sample, by_id: bool) -> tuple[list[int], list[int]]:
    if by_id:
        pos = [table.row(i) for i in s.positive_ids or []]
        neg = [table.row(i) for i in s.negative_ids or []]
        return [r for r in pos if r is not None], [r for r in neg if r is not None]
    return [table.add(t) for t in s.positives], [table.add(t) for t in s.negatives]


def encoded_set(samples: list[Sample], rows: list[tuple[list[int], list[int]]], docs: torch.Tensor,
                 n_neg: int) -> EncodedSet:
    """A split as the trainer takes it: queries, positive rows and ``n_neg`` negative rows (-1: none)."""
    neg = np.full((len(samples), n_neg), -1, dtype=np.int64)
    for i, (_, ns) in enumerate(rows):
        take = ns[:n_neg]
        neg[i, :len(take)] = take
    pos = np.array([p[0] for p, _ in rows], dtype=np.int64)
    return EncodedSet([s.query for s in samples], pos, neg, docs)


@dataclass
class Prepared:
    """Data of a run in index form: the document table and the three splits' rows."""

    table: DocTable
    sets: dict[str, tuple[list[Sample], list[tuple[list[int], list[int]]]]]
    mining: dict[str, Any] | None
    dropped: dict[str, int]


def prepare(cfg: RunConfig, base: BaseEncoder, samples: list[Sample], beir: BeirData | None,
            splits: Any, index: Any, stored: StoredEmbeddings | None, phase: Any,
            encode_base: Encode) -> Prepared:
    """Embed every document once, mine negatives, and turn the splits into document rows."""
    by_id = beir is not None
    # The frozen text tower, used once: every document of the run is embedded (or read
    # from the cache) here; training and evaluation only index into these rows.
    table = DocTable()
    if beir is not None:
        for did, text in zip(beir.corpus_ids, beir.corpus_texts):
            table.add(text, did)
    else:
        for s in samples:
            for t in s.positives + s.negatives:
                table.add(t)
    with phase("documents"):
        table.embed(base, cfg.cache_dir, progress=cfg.progress, stored=stored)
    mining = None
    source = mining_source(cfg, samples)
    if source != "none":
        # Training negatives pass the false-negative cutoff. Validation and test negatives
        # do not: filtered by the base model's own scores, the base would make no error on
        # them by construction and the validation error count could never improve.
        common = dict(index=index if source == "index" else None, k=cfg.mine_k,
                      n_negatives=max(cfg.negatives, 1), cache_dir=cfg.cache_dir, by_id=by_id,
                      progress=cfg.progress, stored=stored, encode_queries=encode_base)
        with phase("mining"):
            mining = {"source": source,
                      "train": mine_negatives(splits.train, base, table, cutoff=cfg.fn_cutoff, **common).to_dict(),
                      "held_out": mine_negatives(splits.validation + splits.test, base, table, cutoff=None,
                                                 **common).to_dict()}
    sets, dropped = {}, {}
    for split_name in ("train", "validation", "test"):
        part = getattr(splits, split_name)
        rows = [_rows(table, s, by_id) for s in part]
        if cfg.loss.kind == "triplet" and split_name != "test":
            # Mining leaves a query without a negative when every candidate scored too close
            # to its positive (probable false negatives): such a query cannot form a triplet.
            keep = [i for i, (_, n) in enumerate(rows) if n]
            dropped[split_name] = len(part) - len(keep)
            if not keep:
                why = (f"; mining dropped {mining['train']['dropped_false_negative']} of "
                       f"{mining['train']['candidates']} candidates "
                       f"as scoring above {cfg.fn_cutoff} x the positive's score" if mining else "")
                raise InvalidInputError(f"no {split_name} query has a negative{why}",
                                        "the triplet loss needs one: mine negatives (--mine corpus / --mine index), "
                                        "raise --fn-cutoff (e.g. 0.99), or use --loss infonce")
            part, rows = [part[i] for i in keep], [rows[i] for i in keep]
        sets[split_name] = (part, rows)
    return Prepared(table, sets, mining, dropped)
