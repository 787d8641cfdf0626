"""``qswap demo``: the tour's example files, so the README's commands run as written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser("demo", help="write the tour's example files from the bundled demo corpus",
                       description="Write corpus.jsonl (400 Debian package descriptions), triplets.jsonl "
                                   "(training triplets: a package's title as the query) and support-queries.jsonl "
                                   "(labelled queries on other packages, for sentinels) into a folder: the files "
                                   "the README's tour reads.")
    p.add_argument("--out", type=Path, default=Path("."), metavar="DIR", help="folder to write into (default: .)")
    p.add_argument("--docs", type=int, default=None, metavar="N", help="use the first N documents (default: all 400)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from qswap.demo import write_tour_files
    from qswap.errors import InvalidInputError
    if args.docs is not None and args.docs < 8:
        raise InvalidInputError(f"--docs {args.docs} is too few", "use at least 8 documents")
    for name, n in write_tour_files(args.out, args.docs).items():
        print(f"{args.out / name}: {n} lines", file=sys.stderr)
    return 0
