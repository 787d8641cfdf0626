"""A tuning run's inputs: training data, evaluation languages and sentinels, the index; all
checked before the model loads (a typo must not cost a whole run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qswap.encoders.base import BaseEncoder
from qswap.errors import InvalidInputError
from qswap.index import IndexBackend
from qswap.tuning.config import MINE_CHOICES, RunConfig
from qswap.tuning.data import BeirData, Sample, read_beir, read_triplets


def load_samples(cfg: RunConfig) -> tuple[list[Sample], BeirData | None, str]:
    """The run's training samples, its BEIR data (``None`` for triplets) and a line saying where they
    come from; refuses contradictory options before anything is loaded."""
    if (cfg.train_file is None) == (cfg.beir_dir is None):
        raise InvalidInputError("give exactly one of --train FILE and --beir DIR", "see `qswap tune run --help`")
    if cfg.mine not in MINE_CHOICES:
        raise InvalidInputError(f"unknown --mine {cfg.mine!r}", f"use one of {', '.join(MINE_CHOICES)}")
    if cfg.mine == "index" and cfg.index is None:
        raise InvalidInputError("--mine index needs --index PATH", "give the qswap index to mine from")
    if cfg.train_file is not None:
        samples = read_triplets(cfg.train_file, require_negatives=cfg.mine == "none" and cfg.loss.kind == "triplet")
        return samples, None, f"triplets {cfg.train_file}"
    lang = cfg.lang
    if lang is None and not (Path(cfg.beir_dir) / "queries.jsonl").exists() \
            and (Path(cfg.beir_dir) / "queries-en.jsonl").exists():
        lang = "en"
    cfg.lang = lang
    beir = read_beir(cfg.beir_dir, lang)
    return beir.samples(), beir, f"BEIR {cfg.beir_dir} [{lang or '-'}]"


def check_inputs(cfg: RunConfig, sentinels: list[Any]) -> None:
    """Every evaluation language and sentinel exists: a typo must not cost a whole run."""
    from qswap.beir import check_beir
    if cfg.eval_langs and cfg.beir_dir is None:
        raise InvalidInputError("--eval-langs needs --beir (languages are BEIR query files)",
                                "drop --eval-langs, or train from a BEIR directory")
    for lang in cfg.eval_langs:
        check_beir(cfg.beir_dir, lang or None)
    for s in sentinels:
        if s.kind == "beir":
            check_beir(s.path, s.query_lang, corpus_lang=s.doc_lang or s.query_lang)
        elif not Path(s.path).is_file():
            raise InvalidInputError(f"sentinel {s.name}: {s.path} is not a file", "give a triplets JSONL file")


def subsample(samples: list[Sample], n: int | None, seed: int) -> list[Sample]:
    """At most ``n`` samples, drawn with ``seed`` (in their order)."""
    if n is None or n >= len(samples):
        return samples
    keep = np.sort(np.random.default_rng(seed + 1).permutation(len(samples))[:n])
    return [samples[i] for i in keep]


def open_run_index(location: str | Path, base: BaseEncoder) -> IndexBackend:
    """The run's index (folder or ``milvus://``), read-only, checked to be in ``base``'s space."""
    from qswap.index import open_index
    return open_index(location, read_only=True, expected_space=base.space)


def mining_source(cfg: RunConfig, samples: list[Sample]) -> str:
    """``auto``: mine only when the triplet loss lacks negatives, from the index if given,
    else from the run's own documents (for BEIR: the corpus)."""
    if cfg.mine != "auto":
        return cfg.mine
    if cfg.loss.kind == "triplet" and any(not s.negatives for s in samples):
        return "index" if cfg.index is not None else "corpus"
    return "none"
