"""``qswap bench embed``: documents/s of the document tower, and of ``qswap index build`` on Ray.

Without ``--ray``: the runtime and precision arms of :mod:`qswap.bench.embed_arms` (torch fp32
before, the ONNX Runtime default, bf16, int8, the GEMM roofline and, with ``--infinity``,
Infinity) on Debian documents. With ``--ray`` (results in ``bench/results/embed/ray/``): the same corpus (the bundled 400-document demo corpus of Debian descriptions; ``--quick``: its
first 64) is built into an index by the local build (one process, torch's own threads) and by
``--ray`` with each worker count (a local Ray cluster started by this command, one CPU per
actor, so each actor runs one torch thread), alternately. Reported: wall time of the whole
build (ingest, embedding, FAISS, manifest; for Ray also starting the actors, each of which
loads the model), documents/s, and the minimum cosine between Ray and local vectors.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from qswap.bench.load_options import ByMode, RunDirs
from qswap.bench.results import default_results_dir, md_table
from qswap.errors import InvalidInputError
from qswap.bench.plots import plot_bars
from qswap.bench.stats import summarize

NAME = "embed"
MODEL = "multilingual-e5-small"
DOCS = ByMode(400, 64)
ARM_DOCS = ByMode(1000, 64)


def parse_workers(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts such as 1,2, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("counts must be >= 1")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true", help="compare index builds in process vs on Ray Data instead")
    p.add_argument("--beir", type=Path, default=None, help="Debian BEIR folder (default: `qswap bench data debian`'s)")
    p.add_argument("--docs", type=int, default=None, help="documents embedded per arm (default 1000; quick 64)")
    p.add_argument("--queries-per-lang", type=int, default=500, help="queries per language for recall@10")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--no-int8", action="store_true", help="leave out the int8 arms")
    p.add_argument("--rss-docs", type=parse_workers, default=None, metavar="N,N",
                   help="also measure the peak RSS of index builds of these document counts (e.g. 5000,40000)")
    p.add_argument("--rss-model", default=None,
                   help="model of the --rss-docs builds (default: --model; 'tiny': a 2-layer random-weight BERT, "
                        "so that 100,000 documents build in minutes: the figure is the pipeline's memory)")
    p.add_argument("--infinity", action="store_true",
                   help="also run Infinity (installed into <data dir>/venvs/infinity on first use)")
    p.add_argument("--workers", type=parse_workers, default=[1, 2], help="Ray actor counts (default 1,2)")
    p.add_argument("--model", default=MODEL, help="base model (bundled name or directory)")
    p.add_argument("--rounds", type=int, default=1, help="builds per arm (default 1)")
    p.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")


def _corpus(n: int, out: Path) -> Path:
    from qswap.demo import demo_corpus
    lines = [line for line in demo_corpus().read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def _min_cos(a_dir: Path, b_dir: Path) -> float:
    from qswap.index import open_index
    with open_index(a_dir, read_only=True) as a, open_index(b_dir, read_only=True) as b:
        ia, ea = a.export_embeddings()
        ib, eb = b.export_embeddings()
        if ia != ib:
            return float("nan")
        ea, eb = ea.astype(np.float64), eb.astype(np.float64)
        return float(((ea * eb).sum(1) / (np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1))).min())


def run(args: argparse.Namespace) -> int:
    """``qswap bench embed``."""
    from qswap.index import IndexConfig, build_index
    from qswap.encoders.runtime.embedder import document_embedder, load_embedder

    quick = bool(args.quick)
    if not args.ray:
        from qswap.bench.embed_arms import run_arms
        if args.docs is None:
            args.docs = ARM_DOCS.pick(quick)
        if args.docs < 1 or args.rounds < 1:
            raise InvalidInputError("--docs and --rounds must be >= 1", "e.g. --docs 1000 --rounds 2")
        return run_arms(args, RunDirs.create(NAME, quick, args.out))
    if args.out is None and not quick:
        args.out = default_results_dir(NAME) / "ray"
    dirs = RunDirs.create(NAME, quick, args.out)
    tmp = dirs.tmp
    n = DOCS.pick(quick)
    corpus = _corpus(n, tmp / "corpus.jsonl")
    emb = load_embedder(args.model)
    cfg = IndexConfig()
    arms: dict[str, Any] = {}

    def local() -> float:
        out = tmp / "local"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        build_index(corpus, out, emb.documents, emb.space, cfg, progress=False, model=args.model).close()
        return time.perf_counter() - t0

    arms["local"] = local
    if args.ray:
        from qswap.index.ray_build import build_index_on_ray, init_ray
        init_ray(None, num_cpus=args.ray_cpus)
        make = functools.partial(document_embedder, args.model)

        def on_ray(w: int) -> float:
            out = tmp / f"ray{w}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            build_index_on_ray(corpus, out, make, emb.space, cfg, workers=w, progress=False,
                               model=args.model).close()
            return time.perf_counter() - t0

        for w in args.workers:
            arms[f"ray x{w}"] = functools.partial(on_ray, w)
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(max(1, args.rounds)):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for a in order:
            s = arms[a]()
            times[a].append(s)
            print(f"{a}: {s:.1f} s, {n / s:.1f} docs/s", file=sys.stderr)
    res: dict[str, Any] = {"documents": n, "model": args.model, "corpus": "bundled demo corpus (Debian descriptions)",
                           "arms": {a: {"seconds": summarize(t), "docs_per_s": n / float(np.median(t))}
                                    for a, t in times.items()},
                           "min_cosine_vs_local": {a: _min_cos(tmp / "local", tmp / a.replace("ray x", "ray"))
                                                   for a in arms if a != "local"}}
    if args.ray:
        import ray
        res["ray_cluster_cpus"] = ray.cluster_resources().get("CPU")
        ray.shutdown()
    rows = [[a, f"{float(np.median(t)):.1f}", f"{n / float(np.median(t)):.1f}",
             f"{res['min_cosine_vs_local'].get(a, 1.0):.6f}" if a != "local" else "-"] for a, t in times.items()]
    plot_bars(dirs.writer.plot_path("docs_per_s.png"), list(times), {"docs/s": [n / float(np.median(t)) for t in times.values()]},
              ylabel="documents/s", title=f"index build of {n} documents: local vs Ray Data")
    dirs.writer.write(res, f"{n} documents, {args.model}; whole build wall time (median of {args.rounds}).\n\n"
                      + md_table(["arm", "seconds", "docs/s", "min cosine vs local"], rows))
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0
