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

# command -> (module that registers it, its one-line help), in the order --help shows them.
# `qswap --help` lists these without importing any of the modules (torch, scipy and faiss
# take seconds to import); `qswap COMMAND ...` imports only COMMAND's module.
# tests/test_layout.py checks that each help line is the one the module registers.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("qswap.server.cli", "run the search server"),
    "index": ("qswap.index.cli", "build, change, query and evaluate document indexes"),
    "encoders": ("qswap.encoders.cli", "base models and query-encoder directories"),
    "tune": ("qswap.tuning.cli", "adiabatic query-tower tuning and the compute planner"),
    "feedback": ("qswap.tuning.cli", "captured traffic as training data (qswap serve --feedback-dir)"),
    "sentinels": ("qswap.tuning.cli", "build the server's sentinel sets (qswap serve --sentinels)"),
    "demo": ("qswap.cli.demo", "write the tour's example files from the bundled demo corpus"),
    "bench": ("qswap.bench.cli", "benchmarks and benchmark data"),
}


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None, *, full: bool = False) -> argparse.ArgumentParser:
    """The ``qswap`` parser.

    Args:
        argv: the command line; only the module of the command it names is imported.
        full: import every command's module (for documentation and tests).

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="qswap",
        description="Retrieval over a frozen document index with query encoders swapped per request.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `qswap COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"qswap {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = _command_of(sys.argv[1:] if argv is None else argv)
    modules = {m for m, _ in COMMANDS.values()} if full else {COMMANDS[wanted][0]} if wanted in COMMANDS else set()
    for module in dict.fromkeys(m for m, _ in COMMANDS.values()):
        if module in modules:
            importlib.import_module(module).register(sub)
    registered = set(sub.choices)
    for name, (_, help_text) in COMMANDS.items():
        if name not in registered:
            sub.add_parser(name, help=help_text)
    # --help lists the commands in COMMANDS' order whichever module registered first
    sub._choices_actions.sort(key=lambda a: list(COMMANDS).index(a.dest))  # type: ignore[attr-defined]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
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
