"""``qswap bench``: benchmarks (each writes ``bench/results/<name>/``) and their data.

Every benchmark has ``--quick`` (a smoke run of seconds, written under
``bench/results/<name>/tmp/quick`` unless ``--out`` says otherwise) and a full mode (at most
about ten minutes on a 2-core machine) that writes ``results.json``, ``README.md`` and PNG
plots to ``bench/results/<name>/``.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qswap.bench import bf16_quality, e2e_latency, encoder_memory, encoder_scale, forward, guard, quality, hotswap, index_bench, naive_baseline, serving, tuning_speed
from qswap.bench import adversarial, cycle, domains, gpu, loop, packed_forward, peer, ray_embed, start
from qswap.bench.data import register as register_data

# (subcommand, module, one-line help); each module has add_arguments(parser) and run(args).
BENCHMARKS = (
    ("serving", serving, "latency/QPS vs concurrency of /v1/search; one vs 8 encoders; time breakdown"),
    ("baseline", naive_baseline, "qswap vs one full model per domain behind FastAPI + FAISS (side by side)"),
    ("index", index_bench, "recall@10, bytes/doc, latency, build time per (dim, quant, kind, rescore)"),
    ("tuning", tuning_speed, "steps/s of qswap tuning vs a sentence-transformers TripletLoss run"),
    ("hotswap", hotswap, "registration-to-first-served time and failed requests during swaps under load"),
    ("embed", ray_embed, "document embedding: runtimes, precisions, roofline, Infinity; --ray: index build on Ray Data"),
    ("scale", encoder_scale, "server RSS with 1..50 LoRA encoders; end-to-end p50 vs encode with a LoRA encoder"),
    ("encoder-memory", encoder_memory, "what a loaded LoRA encoder costs in one process, stage by stage, vs what is counted"),
    ("adversarial", adversarial, "normal clients' p50/p99 and server RSS while one attacker loops costly requests"),
    ("guard", guard, "the server's sentinel guard: registration time on a running server; false alarms and power"),
    ("peer", peer, "qswap vs Infinity (its own venv, same weights): one and four domains, search and embeddings routes"),
    ("cycle", cycle, "where a one-domain server's time goes under load (py-spy profile of every thread)"),
    ("loop", loop, "learning from traffic end to end: capture, tune from clicks, interleave vs A/B, promote"),
    ("gpu", gpu, "qswap on the GPU it finds: query graphs, documents, search, tuning, beside sentence-transformers"),
    ("start", start, "what a start costs on a warm data dir: a server to /readyz and one search, or (--cli) index search and build processes; revisions side by side"),
    ("packed-forward", packed_forward, "the packed (padding-free) query graph vs padded calls on batches of real query lengths"),
    ("domains", domains, "one encoder per Debian section vs base and a general encoder, served at once; learning curve"),
)


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Options every benchmark takes: ``--quick``, ``--out``."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke run taking seconds (results under bench/results/%s/tmp/quick)" % name)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"result directory (default bench/results/{name.replace('-', '_')}/)")


def stops_cleanly(run: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
    """``run`` with SIGTERM turned into ``SystemExit`` while it runs.

    `timeout`, CI runners and process managers stop a benchmark with SIGTERM, whose default action
    ends Python without unwinding: the servers a benchmark started (each in its own session, so a
    terminal's Ctrl-C does not reach them twice) would keep running and load the machine for the
    next benchmark. Raised as ``SystemExit``, the ``with``/``finally`` blocks that stop them run.
    """
    def wrapped(args: argparse.Namespace) -> Any:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_on_signal)
        return run(args)
    return wrapped


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` and its subcommands (benchmarks, ``data``, ``forward``) to ``subparsers``."""
    p = subparsers.add_parser("bench", help="benchmarks and benchmark data", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, module, help_text in BENCHMARKS:
        b = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_arguments(b, name)
        module.add_arguments(b)
        b.set_defaults(func=stops_cleanly(module.run), bench_name=name)
    register_data(sub)
    forward.register(sub)
    bf16_quality.register(sub)
    e2e_latency.register(sub)
    quality.register(sub)
    return p
