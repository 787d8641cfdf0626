"""``qswap bench data``: build benchmark data (``debian``, ``synthetic``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qswap.atomic import staged_dir
from qswap.bench.data import debian
from qswap.errors import ConflictError, InvalidInputError, QswapError

SYNTHETIC_FORMAT = "qswap-synthetic/1"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``data`` command group (``debian``, ``synthetic``) to a subparsers action.

    Each leaf parser sets ``func``: call ``args.func(args)``, which returns an exit status
    and raises :class:`qswap.errors.QswapError` for bad input.
    """
    data = subparsers.add_parser("data", help="build benchmark data sets", description=__doc__)
    sub = data.add_subparsers(dest="data_command", required=True, metavar="{debian,synthetic}")
    deb = sub.add_parser(
        "debian",
        help="Debian package-descriptions retrieval benchmark (BEIR layout) from apt's lists",
        description=debian.__doc__.split("\n\n")[1] if debian.__doc__ else None,
    )
    debian.add_arguments(deb)
    deb.set_defaults(func=debian.run)
    syn = sub.add_parser("synthetic", help="clustered unit vectors + exact top-k, for index scale tests")
    add_synthetic_arguments(syn)
    syn.set_defaults(func=run_synthetic)
    return data


def add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench data synthetic``."""
    parser.add_argument("--out", type=Path, required=True, help="directory for base.npy, queries.npy, gt_ids.npy, gt_scores.npy, meta.json")
    parser.add_argument("--n", type=int, default=1_000_000, help="base vectors (default 1,000,000)")
    parser.add_argument("--queries", type=int, default=1000, help="held-out query vectors (default 1000)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--clusters", type=int, default=1024)
    parser.add_argument("--noise", type=float, default=0.6)
    parser.add_argument("--k", type=int, default=100, help="exact neighbours per query (0: skip ground truth)")
    parser.add_argument("--seed", type=int, default=0)


def run_synthetic(args: argparse.Namespace) -> int:
    """Execute ``qswap bench data synthetic``: write the arrays atomically, print timings."""
    from qswap.bench.data.synthetic import clustered_embeddings, exact_ground_truth

    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not (out / "meta.json").is_file():
        raise ConflictError(f"{out} is not empty and holds no synthetic set", "choose a new or empty --out")
    if args.k < 0:
        raise InvalidInputError(f"--k must be >= 0, got {args.k}", "0 skips the ground truth")
    with staged_dir(out) as staging:
        common = dict(dim=args.dim, n_clusters=args.clusters, seed=args.seed, noise=args.noise, progress=True)
        t0 = time.perf_counter()
        base = clustered_embeddings(args.n, path=staging / "base.npy", **common)
        t_base = time.perf_counter() - t0
        queries = clustered_embeddings(args.queries, stream="queries", path=staging / "queries.npy", **common)
        t_gt = 0.0
        if args.k:
            t0 = time.perf_counter()
            scores, ids = exact_ground_truth(base, queries, args.k, progress=True)
            t_gt = time.perf_counter() - t0
            np.save(staging / "gt_ids.npy", ids)
            np.save(staging / "gt_scores.npy", scores)
        meta = {
            "format": SYNTHETIC_FORMAT, "n": args.n, "queries": args.queries, "dim": args.dim,
            "clusters": args.clusters, "noise": args.noise, "seed": args.seed, "k": args.k,
            "seconds": {"base": round(t_base, 2), "ground_truth": round(t_gt, 2)},
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        del base, queries
        debian._public_mode(staging, 0o777)
    print(f"wrote {out}: {json.dumps(meta)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m qswap.bench.data.cli {debian,synthetic} ...``."""
    parser = argparse.ArgumentParser(prog="qswap bench")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except QswapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
