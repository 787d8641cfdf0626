"""``qswap tune``: run a tuning, plan one, evaluate or register an encoder."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from qswap import DEFAULT_MODEL
from qswap.encoders.precision import PRECISIONS
from qswap.tuning.choices import (LOSSES, LR_RULES, METHOD_NAMES, METRICS, MINE_CHOICES, OPTIMIZERS,
                                  QUERY_RUNTIMES, SCHEDULERS)
from qswap.tuning.recipes import RECIPES, default_recipe, describe, device_spec, resolve

# `qswap tune run` exit status when no epoch improved (2 is a usage error, 1 a failure).
IDENTITY_EXIT = 3


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _langs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def register(subparsers: Any) -> None:
    """Add ``tune`` with ``run``, ``plan``, ``eval`` and ``register`` to the qswap CLI."""
    tune = subparsers.add_parser("tune", help="adiabatic query-tower tuning and the compute planner",
                                 description="Tune a query encoder over a frozen document tower.")
    sub = tune.add_subparsers(dest="tune_command", metavar="SUBCOMMAND", required=True)
    _add_run(sub)
    _add_plan(sub)
    _add_eval(sub)
    _add_register(sub)
    _add_sentinels(subparsers)
    _add_feedback(subparsers)


def _add_feedback(subparsers: Any) -> None:
    p = subparsers.add_parser("feedback", help="captured traffic as training data (qswap serve --feedback-dir)",
                              description="Turn what the server captured (searches and their clicks) into "
                                          "labelled data that `qswap tune run --beir` and `qswap sentinels make` read.")
    sub = p.add_subparsers(dest="feedback_command", metavar="SUBCOMMAND", required=True)
    e = sub.add_parser("export", help="write a domain's feedback as a BEIR directory",
                       description="Clicked documents become relevant; documents skipped above a click, "
                                   "judged non-relevant (training negatives).")
    e.add_argument("--dir", type=Path, required=True, help="the server's --feedback-dir")
    e.add_argument("--index", required=True, help="the served index (document texts)")
    e.add_argument("--domain", help="only this domain alias's searches (default: all)")
    e.add_argument("--out", type=Path, required=True, help="BEIR directory to write")
    e.set_defaults(func=_feedback_export)


def _feedback_export(args: argparse.Namespace) -> int:
    from qswap.tuning.feedback import export_feedback
    s = export_feedback(args.dir, args.index, args.out, args.domain)
    print(f"wrote {args.out}: {s.queries} queries ({s.positives} relevant, {s.negatives} non-relevant judgements "
          f"on {s.documents} documents) from {s.impressions} impressions with feedback")
    return 0


def _add_sentinels(subparsers: Any) -> None:
    p = subparsers.add_parser("sentinels", help="build the server's sentinel sets (qswap serve --sentinels)",
                              description="Sentinel sets for the server's own guard: judged queries over the "
                                          "served index, one folder each (queries.jsonl, qrels/test.tsv).")
    sub = p.add_subparsers(dest="sentinels_command", metavar="SUBCOMMAND", required=True)
    m = sub.add_parser("make", help="sample a sentinel from a BEIR set or labelled query logs",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--beir", type=Path, help="BEIR directory (queries of --lang and their qrels)")
    src.add_argument("--log", type=Path, help='labelled query logs: JSONL {"query", "relevant": [ids], "id"?}')
    m.add_argument("--lang", help="query language (BEIR: queries-<lang>.jsonl); recorded in sentinel.json")
    m.add_argument("--split", default="test", help="BEIR qrels split")
    m.add_argument("--name", help="sentinel name (default: the language, else the source's name)")
    m.add_argument("--out", type=Path, required=True, help="sentinels directory (the one given to --sentinels)")
    m.add_argument("--n", type=int, default=1000, help="queries sampled")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--index", help="the served index: judgements on documents it lacks are dropped")
    m.add_argument("--exclude-qids", type=Path, metavar="FILE",
                   help="query ids to leave out (e.g. the ones an encoder was trained on): one a line or a JSON list")
    m.set_defaults(func=_sentinels_make)


def _sentinels_make(args: argparse.Namespace) -> int:
    from qswap.beir import resolve_language
    from qswap.guard.sentinels import from_beir, from_log, make_sentinel, read_qid_file

    exclude = read_qid_file(args.exclude_qids) if args.exclude_qids else set()
    if args.beir is not None:
        lang = resolve_language(args.beir, args.lang)
        data = from_beir(args.beir, lang, args.split)
        name = args.name or lang or Path(args.beir).name
    else:
        data = from_log(args.log, args.lang)
        name = args.name or args.lang or Path(args.log).stem
    index_ids = None
    if args.index is not None:
        from qswap.index import open_index
        with open_index(args.index, read_only=True) as idx:
            index_ids = idx.export_embeddings()[0]
    meta = make_sentinel(data, args.out, name, args.n, args.seed, index_ids, exclude)
    print(f"sentinel {name}: {meta['queries']} queries (of {meta['available']} available, seed {args.seed}) "
          f"-> {Path(args.out) / name}"
          + (f"; {meta['judgements_dropped_not_in_index']} judgements on documents not in the index dropped"
             if meta["judgements_dropped_not_in_index"] else ""))
    return 0


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="tune a query encoder and write an encoder directory",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Tune the query tower (documents stay frozen), evaluate base vs tuned, "
                                   "run the guard and write an encoder directory with its report.")
    g = p.add_argument_group("data")
    g.add_argument("--train", type=Path, help='triplets JSONL: {"query", "pos": [...], "neg": [...]}')
    g.add_argument("--beir", type=Path, help="BEIR directory: queries -> relevant documents (qrels)")
    g.add_argument("--feedback", type=Path, metavar="DIR", help="captured traffic (the server's --feedback-dir): "
                   "exported with `qswap feedback export` into <out>/feedback-data and used as --beir; "
                   "needs --index")
    g.add_argument("--domain", help="with --feedback: only this domain alias's searches")
    g.add_argument("--lang", help="BEIR training language (queries-<lang>.jsonl); default en when present")
    g.add_argument("--val-size", type=float, default=0.1, help="validation size: fraction (<1) or count")
    g.add_argument("--test-size", type=float, default=0.1, help="test size: fraction (<1) or count")
    g.add_argument("--max-samples", type=int, help="use at most this many samples (seeded choice)")
    g = p.add_argument_group("hard negatives")
    g.add_argument("--index",
                   help="a qswap index of the base's space: documents it holds take its stored embeddings "
                        "(no re-embedding), and --mine index searches it")
    g.add_argument("--mine", default="auto", choices=MINE_CHOICES,
                   help="where hard negatives come from; auto: only when the triplet loss lacks negatives, "
                        "from --index if given, else from the run's own documents (BEIR: the corpus)")
    g.add_argument("--mine-k", type=int, default=30, help="candidates retrieved per query")
    g.add_argument("--negatives", type=int, default=1, help="negatives per query in training")
    g.add_argument("--fn-cutoff", type=float, default=0.95,
                   help="drop a negative scoring above this fraction of the positive's score")
    g = p.add_argument_group("method")
    g.add_argument("--base", default=DEFAULT_MODEL, help="bundled base name or local model directory")
    g.add_argument("--method", default="partial", choices=METHOD_NAMES)
    g.add_argument("--freeze-output-dense", action="store_true", help="partial: also freeze output.dense.weight")
    g.add_argument("--freeze-blocks", type=int, default=None,
                   help="partial: also freeze the first k blocks (default: the recipe's; backward stops above them)")
    g.add_argument("--lora-rank", type=int, default=32)
    g.add_argument("--lora-alpha", type=float, help="default: the rank")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-targets", type=_langs, help="comma-separated module names (default: all dense layers)")
    g = p.add_argument_group("loss")
    g.add_argument("--loss", default="triplet", choices=LOSSES)
    g.add_argument("--metric", default="cos", choices=METRICS)
    g.add_argument("--margin", type=float, default=0.1, help="triplet margin")
    g.add_argument("--temperature", type=float, help="default 0.02 (infonce), 0.01 (samtone, pair)")
    g.add_argument("--no-in-batch", action="store_true", help="infonce/samtone: only own negatives")
    g.add_argument("--bidirectional", action="store_true", help="also the document -> query direction")
    g.add_argument("--doc-side", action="store_true", help="samtone: same-tower negatives on the document side")
    g.add_argument("--pair-alpha", type=float, default=0.1)
    g.add_argument("--matryoshka", type=_ints, default=[], metavar="DIMS",
                   help="comma-separated prefix dimensions, e.g. 384,256")
    g = p.add_argument_group("optimisation")
    g.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="defaults of the options marked 'the recipe's' (default: gpu on a CUDA device, else cpu): " + "; ".join(
                       f"{name} = {describe(name)}" for name in sorted(RECIPES)))
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: the recipe's)")
    g.add_argument("--lr-rule", choices=LR_RULES, default=None,
                   help="sqrt: scale --lr from batch 14 to --batch-size by the square-root rule (default: the recipe's)")
    g.add_argument("--batch-size", type=int, default=None, help="queries per step (default: the recipe's)")
    g.add_argument("--precision", choices=("auto", *PRECISIONS), default=None,
                   help="forward passes of training and validation; auto: bf16 autocast where the device "
                        "multiplies bf16 natively (AVX-512-BF16/AMX, tensor cores), else fp32 (default: the recipe's)")
    g.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="the optimiser's fused kernel (adamw, sgd; default: the recipe's)")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    g.add_argument("--no-momentum", action="store_true", help="beta1 = beta2 = 0 (Adamax without momentum)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--scheduler", default="none", choices=SCHEDULERS)
    g.add_argument("--epoch-batches", type=int, default=None, help="batches per epoch (default: the recipe's)")
    g.add_argument("--max-epochs", type=int, default=None, help="epochs at most (default: the recipe's)")
    g.add_argument("--patience", type=int, default=None, help="stop after this many idle epochs (default: the recipe's)")
    g.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="dropout during training steps (--no-dropout: eval mode; default: the recipe's)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation and guard")
    g.add_argument("--eval-langs", type=_langs, default=[],
                   help="BEIR query languages for the language matrix, e.g. en,de,fr,it")
    g.add_argument("--sentinel", action="append", default=[],
                   help="[NAME=]beir:DIR[:QLANG[-DLANG]] or [NAME=]triplets:FILE (repeatable)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, required=True, help="encoder directory to write")
    g.add_argument("--name", help="encoder name (default: the --out directory name)")
    g.add_argument("--version", default="1")
    g.add_argument("--cache-dir", type=Path, help="document-embedding cache (default <data dir>/doc-cache)")
    g.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--allow-identity", action="store_true",
                   help=f"exit 0 when no epoch improved (the encoder is then the base); without it: exit "
                        f"{IDENTITY_EXIT} with a message")
    g.add_argument("--query-runtime", choices=QUERY_RUNTIMES, default="onnx",
                   help="what encodes queries for mining and evaluation: onnx = the serving path's ONNX Runtime "
                        "export (vectors equal to torch's to cosine >= 0.99999), torch = the reference")
    g.add_argument("--export-dir", type=Path, help="ONNX export cache (default <data dir>/onnx-cache)")
    g.add_argument("--register", metavar="URL", help="register the encoder on this server when done")
    g.add_argument("--token", default=os.environ.get("QSWAP_TOKEN"), help="bearer token (or $QSWAP_TOKEN)")
    g.add_argument("--force", action="store_true", help="register even if the guard failed")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from qswap.tuning.methods import MethodConfig
    from qswap.tuning.optim import sqrt_scaled_lr
    from qswap.tuning.config import LossConfig, RunConfig
    from qswap.tuning.run import run_tuning
    from qswap.tuning.trainer import TrainConfig

    # freeze_blocks is a recipe setting of the partial method only: other methods refuse it.
    freeze = args.freeze_blocks if args.freeze_blocks is not None or args.method == "partial" else 0
    spec = device_spec(args.device)
    args.recipe = args.recipe or default_recipe(spec)
    sched = resolve(args.recipe, spec, lr=args.lr, lr_rule=args.lr_rule, epoch_batches=args.epoch_batches, max_epochs=args.max_epochs,
                    patience=args.patience, batch_size=args.batch_size, precision=args.precision,
                    fused=args.fused if args.optimizer in ("adamw", "sgd") or args.fused else False,
                    dropout=args.dropout, freeze_blocks=freeze)
    if args.feedback is not None:
        from qswap.errors import InvalidInputError
        from qswap.tuning.feedback import export_feedback
        if args.beir is not None or args.train is not None or args.index is None:
            raise InvalidInputError("--feedback replaces --beir / --train and needs --index",
                                    "give --feedback DIR --index IDX [--domain D]")
        args.beir = args.out.with_name(args.out.name + ".feedback-data")
        s = export_feedback(args.feedback, args.index, args.beir, args.domain)
        print(f"feedback: {s.queries} queries with clicks from {s.impressions} impressions -> {args.beir}")
    batch = int(sched["batch_size"])
    lr = sqrt_scaled_lr(batch, base_lr=sched["lr"]) if sched["lr_rule"] == "sqrt" else sched["lr"]
    cfg = RunConfig(
        out=args.out, base=args.base, train_file=args.train, beir_dir=args.beir, lang=args.lang,
        validation=args.val_size, test=args.test_size,
        max_samples=args.max_samples, index=args.index, mine=args.mine,
        mine_k=args.mine_k, negatives=args.negatives, fn_cutoff=args.fn_cutoff,
        method=MethodConfig(kind=args.method, freeze_output_dense=args.freeze_output_dense,
                            freeze_blocks=int(sched["freeze_blocks"]), lora_rank=args.lora_rank,
                            lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            lora_targets=args.lora_targets),
        loss=LossConfig(kind=args.loss, metric=args.metric, margin=args.margin, temperature=args.temperature,
                        in_batch=not args.no_in_batch, bidirectional=args.bidirectional,
                        doc_side=args.doc_side, pair_alpha=args.pair_alpha, matryoshka_dims=args.matryoshka),
        train=TrainConfig(lr=lr, batch_size=batch, epoch_batches=int(sched["epoch_batches"]),
                          max_epochs=int(sched["max_epochs"]), patience=int(sched["patience"]), optimizer=args.optimizer,
                          momentum=not args.no_momentum, weight_decay=args.weight_decay,
                          scheduler=args.scheduler, seed=args.seed, dropout=bool(sched["dropout"]),
                          precision=str(sched["precision"]), fused=bool(sched["fused"])),
        eval_langs=args.eval_langs, sentinels=args.sentinel, name=args.name, version=args.version,
        cache_dir=args.cache_dir, device=args.device, progress=not args.quiet,
        register_url=args.register, token=args.token, force=args.force,
        query_runtime=args.query_runtime, export_dir=args.export_dir,
        recipe={"name": args.recipe, "device": spec.name or spec.kind, "settings": {**sched, "lr": lr}})
    res = run_tuning(cfg)
    print(res.report.summary())
    if res.registration is not None:
        print(f"registered: {json.dumps(res.registration)}")
    if res.report.training["best_epoch"] == 0:
        # An encoder that equals the base is rarely what the user wanted: say so even with --quiet.
        level = "warning" if args.allow_identity else "error"
        print(f"qswap: {level}: no epoch improved both validation loss and validation errors; {args.out} holds "
              "the base model (kind identity) -- check the training data (queries and positives that match), or "
              "try more data, a higher --lr or more --max-epochs; --allow-identity accepts it", file=sys.stderr)
        if not args.allow_identity:
            return IDENTITY_EXIT
    return 0


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="method, data quantity and LoRA rank for a FLOP budget",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Algorithm 1 of the compute-optimal embedding paper on our base model, "
                                   "with the expected wall time from a step measured here.")
    p.add_argument("--budget", type=float, required=True, help="compute budget in FLOP, e.g. 1e16")
    p.add_argument("--base", default=DEFAULT_MODEL)
    p.add_argument("--tokens-per-query", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=14)
    p.add_argument("--epoch-batches", type=int, default=1000)
    p.add_argument("--doc-tokens", type=float, default=0.0, help="document tokens embedded once (frozen tower)")
    p.add_argument("--no-measure", action="store_true", help="do not time a training step")
    p.add_argument("--step-time", type=float, help="seconds per step instead of measuring")
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base
    from qswap.tuning.methods import MethodConfig
    from qswap.tuning.planner import format_plan, make_plan, measure_step_seconds

    base = load_base(args.base, device=args.device)
    plan = make_plan(args.budget, base, tokens_per_query=args.tokens_per_query, batch_size=args.batch_size,
                     epoch_batches=args.epoch_batches, doc_tokens=args.doc_tokens)
    step, alt = args.step_time, None
    if step is None and not args.no_measure:
        step = measure_step_seconds(base, MethodConfig(kind=plan.method, lora_rank=plan.lora_rank or 32),
                                    args.batch_size, args.tokens_per_query)
        alt = measure_step_seconds(base, MethodConfig(kind="partial"), args.batch_size, args.tokens_per_query)
    if step is not None:
        plan.set_step_time(step, alt)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _add_eval(sub: Any) -> None:
    p = sub.add_parser("eval", help="compare a saved encoder with its base on BEIR or triplets",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("encoder", type=Path, help="encoder directory")
    p.add_argument("--beir", type=Path, help="BEIR directory")
    p.add_argument("--langs", type=_langs, default=[], help="query languages for the language matrix")
    p.add_argument("--triplets", type=Path, help="triplets JSONL with negatives")
    p.add_argument("--sentinel", action="append", default=[], help="guard sentinel (as in `tune run`)")
    p.add_argument("--base", help="base model (default: the manifest's space name, bundled)")
    p.add_argument("--heatmap", type=Path, help="write the language-matrix PNG here")
    p.add_argument("--include-seen", action="store_true",
                   help="also score the queries the encoder was trained or validated on (left out by default, "
                        "by id, from the encoder's training_queries.json)")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--index",
                   help="a qswap index of the base's space: documents it holds take its stored vectors "
                        "(no re-embedding)")
    p.add_argument("--device")
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from qswap.encoders import load_query_encoder
    from qswap.errors import InvalidInputError
    from qswap.tuning.beir_eval import BeirEvaluator
    from qswap.guard.sentinels import parse_sentinel
    from qswap.tuning.sentinel_scores import evaluate_sentinels, triplet_metrics
    from qswap.guard.evaluation import compare_metrics
    from qswap.tuning.multilingual import language_matrix, plot_heatmap

    if not (args.beir or args.triplets or args.sentinel):
        raise InvalidInputError("nothing to evaluate on", "give --beir, --triplets or --sentinel")
    loaded = load_query_encoder(args.encoder, args.base, device=args.device)
    base, encode = loaded.base, loaded.encode
    out: dict[str, Any] = {"encoder": loaded.key}
    stored = None
    if args.index is not None:
        from qswap.index import open_index
        from qswap.tuning.doc_cache import StoredEmbeddings
        with open_index(args.index, read_only=True) as idx:
            stored = StoredEmbeddings.from_index(idx)
    # Progress on a terminal or not: bars, else a line every 15 s (qswap.tuning.progress).
    evaluator = BeirEvaluator(base, encode, args.cache_dir, progress=True, stored=stored)
    seen = set() if args.include_seen else _seen_queries(args.encoder, args.beir, args.langs or [None])
    out["excluded_seen_queries"] = len(seen)
    if args.beir:
        langs = args.langs or [None]
        m = language_matrix(evaluator, args.beir, langs, exclude_qids=seen)
        out["beir"] = m.to_dict()
        if args.heatmap:
            plot_heatmap(m, args.heatmap)
    if args.triplets:
        b, t = triplet_metrics(args.triplets, base, encode, args.cache_dir, progress=True)
        out["triplets"] = compare_metrics(b, t)
    if args.sentinel:
        sents = [parse_sentinel(s) for s in args.sentinel]
        excl = {Path(s.path).resolve(): seen for s in sents if s.kind == "beir"}
        out["guard"] = evaluate_sentinels(sents, base, encode, evaluator, args.cache_dir, exclude=excl).to_json()
    print(json.dumps(out, indent=2))
    return 0


def _seen_queries(encoder_dir: Path, beir: Path | None, langs: list[str | None]) -> set[str]:
    """Ids of the queries the encoder trained on (train + validation), to leave out; warns on
    stderr when there is no such record or when the ids do not match the evaluated queries."""
    from qswap.beir import read_queries
    from qswap.tuning.config import SEEN_QUERIES

    path = Path(encoder_dir) / SEEN_QUERIES
    if not path.is_file():
        print(f"qswap: warning: {encoder_dir} has no {SEEN_QUERIES} (trained on triplets, or not by `qswap tune run`): "
              "trained-on queries cannot be left out; scores may flatter the encoder", file=sys.stderr)
        return set()
    seen = set(json.loads(path.read_text()).get("ids") or [])
    if beir is not None and seen:
        for lang in langs:
            try:
                ids = set(read_queries(beir, lang))
            except Exception:   # a missing language fails with its own message in the evaluation
                continue
            if not ids & seen:
                print(f"qswap: warning: none of the {len(seen)} trained-on query ids occurs in the {lang or 'default'} "
                      "queries: they cannot be matched by id (other ids across languages?), so none is left out "
                      "there", file=sys.stderr)
    return seen


def _add_register(sub: Any) -> None:
    p = sub.add_parser("register", help="upload an encoder directory to a running server")
    p.add_argument("encoder", type=Path, help="encoder directory")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://localhost:8000")
    p.add_argument("--token", default=os.environ.get("QSWAP_TOKEN"), help="bearer token (or $QSWAP_TOKEN)")
    p.add_argument("--force", action="store_true", help="register even if the guard failed")
    p.set_defaults(func=_register)


def _register(args: argparse.Namespace) -> int:
    from qswap.tuning.register import register_encoder

    print(json.dumps(register_encoder(args.encoder, args.url, args.token, force=args.force), indent=2))
    return 0
