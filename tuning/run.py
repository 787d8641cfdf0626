"""One tuning run end to end: data -> frozen documents -> training -> evaluation -> encoder.

:func:`run_tuning` is what ``qswap tune run`` calls. It writes an encoder directory (the
format of :mod:`qswap.encoders.artifact`) whose manifest carries the training summary and
the guard verdict, with ``report.json``, ``report.md`` and PNGs inside it; optionally it
registers the encoder on a running server.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap import DEFAULT_MODEL
from qswap.atomic import atomic_write_json
from qswap.encoders import load_base, save_encoder
from qswap.encoders.base import BaseEncoder
from qswap.errors import IntegrityError, InvalidInputError
from qswap.index import IndexBackend
from qswap.tuning.beir_eval import BeirEvaluator
from qswap.tuning.data import BeirData, Sample, read_beir, read_triplets, split_samples
from qswap.tuning.doc_cache import DocTable, StoredEmbeddings
from qswap.guard.evaluation import compare_metrics, evaluate_candidates
from qswap.guard.checks import guard_record, sentinel_check
from qswap.guard.sentinels import parse_sentinel
from qswap.tuning.guard import evaluate_sentinels
from qswap.tuning.layers import changes_report
from qswap.tuning.losses import build_loss
from qswap.tuning.methods import MethodConfig, QueryTower
from qswap.tuning.mining import mine_negatives
from qswap.tuning.queries import Encode, FastQueries, QueryTokens
from qswap.tuning.multilingual import language_matrix, plot_heatmap
from qswap.tuning.report import HEATMAP, write_report
from qswap.tuning.trainer import EncodedSet, TrainConfig, train


MINE_CHOICES = ("auto", "corpus", "index", "none")
QUERY_RUNTIMES = ("onnx", "torch")      # what encodes queries for mining and evaluation
SEEN_QUERIES = "training_queries.json"   # ids of the train + validation queries, in the encoder directory


@dataclass
class LossConfig:
    """Which loss and its options (see :func:`qswap.tuning.losses.build_loss`)."""

    kind: str = "triplet"
    metric: str = "cos"
    margin: float = 0.1
    temperature: float | None = None
    in_batch: bool = True
    bidirectional: bool = False
    doc_side: bool = False
    pair_alpha: float = 0.1
    matryoshka_dims: list[int] = field(default_factory=list)

    def build(self):
        return build_loss(self.kind, metric=self.metric, margin=self.margin, temperature=self.temperature,
                          in_batch=self.in_batch, bidirectional=self.bidirectional, doc_side=self.doc_side,
                          pair_alpha=self.pair_alpha, matryoshka_dims=self.matryoshka_dims or None)


@dataclass
class RunConfig:
    """Everything ``qswap tune run`` takes."""

    out: Path
    base: str = DEFAULT_MODEL
    train_file: Path | None = None          # triplets JSONL
    beir_dir: Path | None = None            # or a BEIR directory (queries -> relevant docs)
    lang: str | None = None                 # BEIR training language ("en" when per-language files)
    validation: float = 0.1                 # fraction (< 1) or count
    test: float = 0.1
    max_samples: int | None = None
    index: str | Path | None = None         # a qswap index (folder or milvus://) of the base's space
    mine: str = "auto"                      # auto | corpus | index | none (see _mining_source)
    mine_k: int = 30
    negatives: int = 1                      # negatives per query used in training
    fn_cutoff: float = 0.95
    method: MethodConfig = field(default_factory=MethodConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval_langs: list[str] = field(default_factory=list)
    sentinels: list[str] = field(default_factory=list)
    name: str | None = None
    version: str = "1"
    cache_dir: Path | None = None
    device: str | None = None
    progress: bool = True
    register_url: str | None = None
    token: str | None = None
    force: bool = False
    query_runtime: str = "onnx"             # onnx: the serving path's fast runtime; torch: the reference
    export_dir: Path | None = None          # ONNX export cache (default <data dir>/onnx-cache)
    recipe: dict[str, Any] | None = None    # the recipe's name and the settings it resolved to (report.json)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token", None)   # never write a credential into a report
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


@dataclass
class RunResult:
    encoder_dir: Path
    report: dict[str, Any]
    registration: dict[str, Any] | None = None


def _load_samples(cfg: RunConfig) -> tuple[list[Sample], BeirData | None, str]:
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


def _check_inputs(cfg: RunConfig, sentinels: list[Any]) -> None:
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


def _subsample(samples: list[Sample], n: int | None, seed: int) -> list[Sample]:
    if n is None or n >= len(samples):
        return samples
    keep = np.sort(np.random.default_rng(seed + 1).permutation(len(samples))[:n])
    return [samples[i] for i in keep]


def _open_index(location: str | Path, base: BaseEncoder) -> IndexBackend:
    from qswap.index import open_index
    return open_index(location, read_only=True, expected_space=base.space)


def _mining_source(cfg: RunConfig, samples: list[Sample]) -> str:
    """``auto``: mine only when the triplet loss lacks negatives, from the index if given,
    else from the run's own documents (for BEIR: the corpus)."""
    if cfg.mine != "auto":
        return cfg.mine
    if cfg.loss.kind == "triplet" and any(not s.negatives for s in samples):
        return "index" if cfg.index is not None else "corpus"
    return "none"


def _rows(table: DocTable, s: Sample, by_id: bool) -> tuple[list[int], list[int]]:
    if by_id:
        pos = [table.row(i) for i in s.positive_ids or []]
        neg = [table.row(i) for i in s.negative_ids or []]
        return [r for r in pos if r is not None], [r for r in neg if r is not None]
    return [table.add(t) for t in s.positives], [table.add(t) for t in s.negatives]


def _encoded(samples: list[Sample], rows: list[tuple[list[int], list[int]]], docs: torch.Tensor,
             n_neg: int) -> EncodedSet:
    neg = np.full((len(samples), n_neg), -1, dtype=np.int64)
    for i, (_, ns) in enumerate(rows):
        take = ns[:n_neg]
        neg[i, :len(take)] = take
    pos = np.array([p[0] for p, _ in rows], dtype=np.int64)
    return EncodedSet([s.query for s in samples], pos, neg, docs)


def _artifact_check(fast: FastQueries, tower: QueryTower, key: str, encode: Encode,
                    queries: list[str]) -> dict[str, Any]:
    """Compare the saved encoder ``key`` (loaded into ``fast``'s pool the way the server loads
    it) and its fast-runtime ``encode`` with the trained tower."""
    served = fast.pool.encode(queries, [key] * len(queries))
    trained = tower.encode(queries)
    diff = float(np.abs(served - trained).max()) if len(queries) else 0.0
    if diff > 1e-4:
        raise IntegrityError(f"the saved encoder does not reproduce the tuned tower (max difference {diff:.2e})",
                             "this is a bug in the adapter export; report it with the run's options")
    cos = float((encode(queries) * trained).sum(axis=1).min()) if len(queries) else 1.0
    return {"queries": len(queries), "max_abs_difference": diff, "runtime": fast.runtime.get(key),
            "runtime_min_cosine": cos}


@dataclass
class _Prepared:
    """Data of a run in index form: the document table and the three splits' rows."""

    table: DocTable
    sets: dict[str, tuple[list[Sample], list[tuple[list[int], list[int]]]]]
    mining: dict[str, Any] | None
    dropped: dict[str, int]


def _prepare(cfg: RunConfig, base: BaseEncoder, samples: list[Sample], beir: BeirData | None,
             splits: Any, index: Any, stored: StoredEmbeddings | None, phase: "_Phases",
             encode_base: Encode) -> _Prepared:
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
    source = _mining_source(cfg, samples)
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
    return _Prepared(table, sets, mining, dropped)


def _evaluate(cfg: RunConfig, base: BaseEncoder, encode_base: Encode, encode_tuned: Encode, prep: _Prepared,
              beir: BeirData | None, splits: Any, sentinels: list[Any], report_dir: Path,
              stored: StoredEmbeddings | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(evaluation, guard): base vs tuned on the test split, languages and sentinels."""
    evaluation: dict[str, Any] = {}
    # The guard also checks the training task itself, on its held-out test queries: an
    # encoder can get worse where it was tuned.
    own: list[dict[str, Any]] = []
    test_samples, test_rows = prep.sets["test"]
    if test_samples and beir is None:
        # Triplet data: each test query against its own candidates.
        q = [s.query for s in test_samples]
        pos, neg = [r[0] for r in test_rows], [r[1] for r in test_rows]
        mb = evaluate_candidates(encode_base(q), prep.table.emb, pos, neg)
        mt = evaluate_candidates(encode_tuned(q), prep.table.emb, pos, neg)
        evaluation["test"] = compare_metrics(mb, mt)
        own.append(sentinel_check("training data (held-out test)", mb, mt))
    evaluator = BeirEvaluator(base, encode_tuned, cfg.cache_dir, cfg.progress, stored=stored, encode_base=encode_base)
    if beir is not None and test_samples:
        # BEIR: test queries against the whole corpus, in every evaluation language.
        langs = cfg.eval_langs or [cfg.lang or ""]
        matrix = language_matrix(evaluator, cfg.beir_dir, [lg or None for lg in langs],
                                 keep_qids={s.qid for s in test_samples})
        main_cell = matrix.cells.get((cfg.lang, cfg.lang)) or matrix.cells.get((cfg.lang, None))
        if main_cell is not None:
            evaluation["retrieval"] = main_cell.comparison()
            own.append(sentinel_check(f"{cfg.lang or 'training'} (held-out test)", main_cell.base, main_cell.tuned,
                                      lang=cfg.lang))
        evaluation["multilingual"] = matrix.to_dict()
        plot_heatmap(matrix, report_dir / HEATMAP)
    if not sentinels:
        return evaluation, guard_record(own)
    exclude = None
    if beir is not None:
        # A sentinel in the training directory must not score queries the tuning saw.
        exclude = {Path(cfg.beir_dir).resolve(): {s.qid for s in splits.train + splits.validation}}
    return evaluation, evaluate_sentinels(sentinels, base, encode_tuned, evaluator, cfg.cache_dir,
                                          exclude=exclude, progress=cfg.progress, extra_checks=own)


class _Phases:
    """Wall seconds per phase of a run (report.json ``phases``, the CLI summary's ``time`` line):
    a user who waits wants to see where the time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t0, 3)


def run_tuning(cfg: RunConfig) -> RunResult:
    """Run one tuning end to end and write the encoder directory ``cfg.out``."""
    t_start, cpu_start = time.perf_counter(), time.process_time()
    phase = _Phases()
    out = Path(cfg.out)
    name = cfg.name or out.name
    loss_fn = cfg.loss.build()
    cfg.method.validate()
    cfg.train.validate()
    if cfg.query_runtime not in QUERY_RUNTIMES:
        raise InvalidInputError(f"unknown query runtime {cfg.query_runtime!r}", f"use one of {', '.join(QUERY_RUNTIMES)}")
    sentinels = [parse_sentinel(s) for s in cfg.sentinels]
    samples, beir, source = _load_samples(cfg)     # bad data fails before the model loads
    _check_inputs(cfg, sentinels)                  # so do unknown languages and missing sentinel files
    with phase("load"):
        base = load_base(cfg.base, device=cfg.device)
        samples = _subsample(samples, cfg.max_samples, cfg.train.seed)
        splits = split_samples(samples, cfg.validation, cfg.test, cfg.train.seed)
        index = _open_index(cfg.index, base) if cfg.index is not None else None
        stored = StoredEmbeddings.from_index(index) if index is not None else None
    # Every query of the run is tokenised once (mining, training, validation, evaluation).
    tokens = QueryTokens(base.tokenizer, base.spec.query_prefix)
    fast = FastQueries(base, tokens, cfg.export_dir, enabled=cfg.query_runtime == "onnx")
    try:
        with phase("query runtime"):
            encode_base = fast.base_encoder()      # the base's export: cached across runs
        prep = _prepare(cfg, base, samples, beir, splits, index, stored, phase, encode_base)
        docs = torch.from_numpy(np.ascontiguousarray(prep.table.emb)).to(base.device)

        with phase("training"):
            tower = QueryTower(base, cfg.method)
            result = train(tower, loss_fn, _encoded(*prep.sets["train"], docs, cfg.negatives),
                           _encoded(*prep.sets["validation"], docs, cfg.negatives), cfg.train,
                           progress=cfg.progress, tokens=tokens)
        return _finish(cfg, name, out, base, tower, result, prep, beir, splits, sentinels, stored, fast,
                       encode_base, loss_fn, source, phase, t_start, cpu_start)
    finally:
        fast.close()


def _finish(cfg: RunConfig, name: str, out: Path, base: BaseEncoder, tower: QueryTower, result: Any,
            prep: _Prepared, beir: BeirData | None, splits: Any, sentinels: list[Any],
            stored: StoredEmbeddings | None, fast: FastQueries, encode_base: Encode, loss_fn: Any,
            source: str, phase: _Phases, t_start: float, cpu_start: float) -> RunResult:
    """Export the tuned tower, check the saved encoder, evaluate it, write the report and the encoder."""
    workdir = Path(tempfile.mkdtemp(prefix=".tune-", dir=out.parent if out.parent.exists() else None))
    try:
        report_dir = workdir / "report"
        original = dict(base.model.named_parameters())
        tuned = tower.tuned_tensors()
        layers = changes_report({n: original[n] for n in tuned}, tuned)
        # Nothing beat the untuned model on validation: the honest encoder is the base.
        identity = result.best_epoch == 0
        exported = None if identity else tower.export(workdir)
        kind = "identity" if identity else exported.kind
        check, encode_tuned = None, encode_base
        if not identity:
            # Evaluated as saved: the probe encoder, loaded the way the server loads it and
            # run on the fast query runtime (checked against the trained tower first).
            probe = workdir / "probe"
            save_encoder(probe, name=name, version=cfg.version, kind=kind, space=base.space,
                         tensors=exported.tensors, lora_dir=exported.lora_dir)
            probe_queries = [s.query for s in (prep.sets["test"][0] or prep.sets["validation"][0])][:64]
            with phase("query runtime"):
                key, encode_tuned = fast.tuned_encoder(probe)
            with phase("artifact check"):
                check = _artifact_check(fast, tower, key, encode_tuned, probe_queries)
        with phase("evaluation"):
            evaluation, guard = _evaluate(cfg, base, encode_base, encode_tuned, prep, beir, splits, sentinels,
                                          report_dir, stored)
        # Sizes actually used: queries mining left without a negative are not trained on.
        used = {name: len(part) for name, (part, _) in prep.sets.items()}
        data = {"source": source, "splits": used, "split_before_mining": splits.sizes(),
                "documents": len(prep.table)}
        # "full" is saved in the partial format (every tuned tensor, embeddings included): the
        # manifest's kind says how to load it, training.method.kind how it was tuned.
        training = {"method": cfg.method.to_dict(), "saved_as": kind, "loss": loss_fn.config(), "optim": cfg.train.to_dict(),
                    "recipe": cfg.recipe, "best_epoch": result.best_epoch, "epochs": len(result.history) - 1,
                    "stopped": result.stopped, "steps": result.steps, "wall_seconds": result.wall_seconds,
                    "data": data}
        report = {
            "encoder": {"name": name, "version": cfg.version, "kind": kind, "path": str(out)},
            "base": {"name": base.name, "fingerprint": base.space.fingerprint, "space": base.space.to_dict()},
            "method": cfg.method.to_dict(), "loss": loss_fn.config(), "recipe": cfg.recipe,
            "data": {**data, "mining": prep.mining, "dropped_without_negative": prep.dropped},
            "training": result.to_dict(), "evaluation": evaluation, "guard": guard, "layers": layers,
            "artifact_check": check, "query_runtime": dict(fast.runtime), "tokenised_queries": len(fast.tokens),
            "config": cfg.to_dict(), "phases": phase.seconds,
            "wall_seconds_total": time.perf_counter() - t_start,
            # CPU seconds of every thread: on a shared machine, less sensitive to load than wall time.
            "cpu_seconds_total": time.process_time() - cpu_start,
        }
        files = write_report(report, report_dir)
        if beir is not None:
            # `qswap tune eval` leaves these out by default: scores on trained-on queries flatter.
            seen = {"source": str(cfg.beir_dir), "lang": cfg.lang,
                    "ids": sorted(s.qid for s in splits.train + splits.validation if s.qid is not None)}
            atomic_write_json(report_dir / SEEN_QUERIES, seen)
            files.append(report_dir / SEEN_QUERIES)
        save_encoder(out, name=name, version=cfg.version, kind=kind, space=base.space,
                     tensors=None if identity else exported.tensors,
                     lora_dir=None if identity else exported.lora_dir,
                     training=training, guard=guard, extra_files=files)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    registration = None
    if cfg.register_url:
        from qswap.tuning.register import register_encoder
        registration = register_encoder(out, cfg.register_url, cfg.token, force=cfg.force)
    return RunResult(encoder_dir=out, report=report, registration=registration)
