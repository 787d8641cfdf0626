"""One tuning run end to end: data -> frozen documents -> training -> evaluation -> encoder.

:func:`run_tuning` is what ``qswap tune run`` calls. It writes an encoder directory (the
format of :mod:`qswap.encoders.artifact`) whose manifest carries the training summary and
the guard verdict, with ``report.json``, ``report.md`` and PNGs inside it; optionally it
registers the encoder on a running server. The steps live beside it: options
(:mod:`~qswap.tuning.config`), inputs (:mod:`~qswap.tuning.inputs`), data preparation
(:mod:`~qswap.tuning.preparation`), evaluation (:mod:`~qswap.tuning.evaluate_run`) and the
encoder's export (:mod:`~qswap.tuning.export`, which saves it once).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from qswap.atomic import atomic_write_json
from qswap.encoders import load_base
from qswap.encoders.base import BaseEncoder
from qswap.errors import InvalidInputError
from qswap.guard import GuardRecord
from qswap.guard.sentinels import parse_sentinel
from qswap.tuning.config import QUERY_RUNTIMES, SEEN_QUERIES, RunConfig, RunResult
from qswap.tuning.data import BeirData, split_samples
from qswap.tuning.doc_cache import StoredEmbeddings
from qswap.tuning.evaluate_run import artifact_check, evaluate_run
from qswap.tuning.export import publish, save_draft
from qswap.tuning.inputs import check_inputs, load_samples, open_run_index, subsample
from qswap.tuning.layers import changes_report
from qswap.tuning.methods import QueryTower
from qswap.tuning.preparation import Prepared, encoded_set, prepare
from qswap.tuning.queries import Encode, FastQueries, QueryTokens
from qswap.tuning.report import write_report
from qswap.tuning.run_report import BaseModelOf, EncoderWritten, RunReport
from qswap.tuning.trainer import TrainResult, train


class _Phases:
    """Wall seconds per phase of a run (report.json ``phases``, the CLI summary's ``time`` line):
    a user who waits wants to see where the time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t0, 3)


@dataclass
class _Run:
    """What every step of one run reads: its options and the parts built before training
    (set once by :func:`run_tuning`, never changed after)."""

    cfg: RunConfig
    name: str
    out: Path
    base: BaseEncoder
    loss_fn: Any
    source: str                          # where the samples came from (report.json data.source)
    beir: BeirData | None
    splits: Any
    sentinels: list[Any]
    stored: StoredEmbeddings | None
    fast: FastQueries
    encode_base: Encode
    prep: Prepared
    phase: _Phases
    t_start: float                       # wall and CPU clocks at the start (the report's totals)
    cpu_start: float


def run_tuning(cfg: RunConfig) -> RunResult:
    """Run one tuning end to end and write the encoder directory ``cfg.out``."""
    t_start, cpu_start = time.perf_counter(), time.process_time()
    phase = _Phases()
    out = Path(cfg.out)
    loss_fn = cfg.loss.build()
    cfg.method.validate()
    cfg.train.validate()
    if cfg.query_runtime not in QUERY_RUNTIMES:
        raise InvalidInputError(f"unknown query runtime {cfg.query_runtime!r}", f"use one of {', '.join(QUERY_RUNTIMES)}")
    sentinels = [parse_sentinel(s) for s in cfg.sentinels]
    samples, beir, source = load_samples(cfg)      # bad data fails before the model loads
    check_inputs(cfg, sentinels)                   # so do unknown languages and missing sentinel files
    with phase("load"):
        base = load_base(cfg.base, device=cfg.device)
        samples = subsample(samples, cfg.max_samples, cfg.train.seed)
        splits = split_samples(samples, cfg.validation, cfg.test, cfg.train.seed)
        index = open_run_index(cfg.index, base) if cfg.index is not None else None
        stored = StoredEmbeddings.from_index(index) if index is not None else None
    # Every query of the run is tokenised once (mining, training, validation, evaluation).
    tokens = QueryTokens(base.tokenizer, base.spec.query_prefix)
    fast = FastQueries(base, tokens, cfg.export_dir, enabled=cfg.query_runtime == "onnx")
    try:
        with phase("query runtime"):
            encode_base = fast.base_encoder()      # the base's export: cached across runs
        prep = prepare(cfg, base, samples, beir, splits, index, stored, phase, encode_base)
        docs = torch.from_numpy(np.ascontiguousarray(prep.table.emb)).to(base.device)

        with phase("training"):
            tower = QueryTower(base, cfg.method)
            result = train(tower, loss_fn, encoded_set(*prep.sets["train"], docs, cfg.negatives),
                           encoded_set(*prep.sets["validation"], docs, cfg.negatives), cfg.train,
                           progress=cfg.progress, tokens=tokens)
        run = _Run(cfg=cfg, name=cfg.name or out.name, out=out, base=base, loss_fn=loss_fn, source=source,
                   beir=beir, splits=splits, sentinels=sentinels, stored=stored, fast=fast,
                   encode_base=encode_base, prep=prep, phase=phase, t_start=t_start, cpu_start=cpu_start)
        return _finish(run, tower, result)
    finally:
        fast.close()


def _finish(run: _Run, tower: QueryTower, result: TrainResult) -> RunResult:
    """Export the tuned tower, check the saved encoder, evaluate it, write the report and the encoder."""
    cfg, out, phase = run.cfg, run.out, run.phase
    workdir = Path(tempfile.mkdtemp(prefix=".tune-", dir=out.parent if out.parent.exists() else None))
    try:
        report_dir = workdir / "report"
        kind, draft, check, encode_tuned = _save_and_check(run, tower, result, workdir)
        with phase("evaluation"):
            evaluation, guard = evaluate_run(cfg, run.base, run.encode_base, encode_tuned, run.prep, run.beir,
                                             run.splits, run.sentinels, report_dir, run.stored)
        report = _report(run, tower, result, kind, check, evaluation, guard)
        files = write_report(report, report_dir)
        if run.beir is not None:
            # `qswap tune eval` leaves these out by default: scores on trained-on queries flatter.
            seen = {"source": str(cfg.beir_dir), "lang": cfg.lang,
                    "ids": sorted(s.qid for s in run.splits.train + run.splits.validation if s.qid is not None)}
            atomic_write_json(report_dir / SEEN_QUERIES, seen)
            files.append(report_dir / SEEN_QUERIES)
        # "full" is saved in the partial format (every tuned tensor, embeddings included): the
        # manifest's kind says how to load it, training.method.kind how it was tuned.
        training = {"method": cfg.method.to_dict(), "saved_as": kind, "loss": run.loss_fn.config(),
                    "optim": cfg.train.to_dict(), "recipe": cfg.recipe, "best_epoch": result.best_epoch,
                    "epochs": len(result.history) - 1, "stopped": result.stopped, "steps": result.steps,
                    "wall_seconds": result.wall_seconds, "data": _data(run)}
        publish(out, draft, name=run.name, version=cfg.version, space=run.base.space, training=training,
                guard=guard.to_json(), files=files)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    registration = None
    if cfg.register_url:
        from qswap.tuning.register import register_encoder
        registration = register_encoder(out, cfg.register_url, cfg.token, force=cfg.force)
    return RunResult(encoder_dir=out, report=report, registration=registration)


def _save_and_check(run: _Run, tower: QueryTower, result: TrainResult,
                    workdir: Path) -> tuple[str, Path | None, dict[str, Any] | None, Encode]:
    """Save the tuned tower once as a draft and check it reproduces the tower: (kind, draft,
    artifact check, its query encoder). Nothing beat the untuned model on validation: the honest
    encoder is the base (``identity``, no draft)."""
    if result.best_epoch == 0:
        return "identity", None, None, run.encode_base
    # Saved once, evaluated as saved: the draft, loaded the way the server loads it and run on
    # the fast query runtime (checked against the trained tower first).
    kind, draft = save_draft(tower, workdir, run.name, run.cfg.version, run.base.space)
    sets = run.prep.sets
    probe_queries = [s.query for s in (sets["test"][0] or sets["validation"][0])][:64]
    with run.phase("query runtime"):
        key, encode_tuned = run.fast.tuned_encoder(draft)
    with run.phase("artifact check"):
        check = artifact_check(run.fast, tower, key, encode_tuned, probe_queries)
    return kind, draft, check, encode_tuned


def _data(run: _Run) -> dict[str, Any]:
    """Sizes actually used: queries mining left without a negative are not trained on."""
    used = {name: len(part) for name, (part, _) in run.prep.sets.items()}
    return {"source": run.source, "splits": used, "split_before_mining": run.splits.sizes(),
            "documents": len(run.prep.table)}


def _report(run: _Run, tower: QueryTower, result: TrainResult, kind: str, check: dict[str, Any] | None,
            evaluation: dict[str, Any], guard: GuardRecord) -> RunReport:
    cfg, base = run.cfg, run.base
    original = dict(base.model.named_parameters())
    tuned = tower.tuned_tensors()
    return RunReport(
        encoder=EncoderWritten(name=run.name, version=cfg.version, kind=kind, path=str(run.out)),
        base=BaseModelOf(name=base.name, fingerprint=base.space.fingerprint, space=base.space.to_dict()),
        method=cfg.method.to_dict(), loss=run.loss_fn.config(), recipe=cfg.recipe,
        data={**_data(run), "mining": run.prep.mining, "dropped_without_negative": run.prep.dropped},
        training=result.to_dict(), evaluation=evaluation, guard=guard,
        layers=changes_report({n: original[n] for n in tuned}, tuned), artifact_check=check,
        query_runtime=dict(run.fast.runtime), tokenised_queries=len(run.fast.tokens), config=cfg.to_dict(),
        phases=run.phase.seconds, wall_seconds_total=time.perf_counter() - run.t_start,
        cpu_seconds_total=time.process_time() - run.cpu_start)
