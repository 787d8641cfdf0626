"""Shared command-line options of the load tests and the set-up of one run (result and scratch dirs)."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from qswap.bench.results import ResultWriter, results_dir_for

if TYPE_CHECKING:
    from qswap.bench.loadgen import LoadResult, Request


#: Where load tests send their traffic: servers under test listen on loopback only.
LOAD_HOST = "127.0.0.1"
MODEL_HELP = "base model (bundled name or directory)"

T = TypeVar("T")


def _show(value: Any) -> str:
    """A default as help text shows it: ``8.0`` -> ``8``, ``(1, 4)`` -> ``1,4``."""
    if isinstance(value, (tuple, list)):
        return ",".join(_show(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class ByMode(Generic[T]):
    """A default that differs between a full run and a ``--quick`` smoke run."""

    full: T
    quick: T

    def pick(self, quick: bool) -> T:
        """The default for this mode."""
        return self.quick if quick else self.full

    def describe(self) -> str:
        """``"default 8; quick 2"``, for help texts."""
        return f"default {_show(self.full)}; quick {_show(self.quick)}"


@dataclass(frozen=True)
class LoadDefaults:
    """One command's defaults for the shared load options (see :func:`add_load_arguments`).

    ``rounds_help`` names what a round is for that command ("A/B rounds per level", ...).
    """

    levels: ByMode[tuple[int, ...]]
    seconds: ByMode[float]
    requests: ByMode[int]
    rounds: ByMode[int]
    rounds_help: str = "rounds per level"


def parse_levels(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``: the argparse type of ``--concurrency`` levels."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None


def add_load_arguments(parser: argparse.ArgumentParser, defaults: LoadDefaults) -> None:
    """Add ``--concurrency`` (levels), ``--seconds``, ``--requests`` and ``--rounds``.

    Every flag defaults to ``None``; :meth:`LoadOptions.from_args` fills in the command's
    ``defaults`` for the mode (full or ``--quick``), which the help texts quote.
    """
    parser.add_argument("--concurrency", type=parse_levels, default=None,
                        help=f"comma-separated levels ({defaults.levels.describe()})")
    parser.add_argument("--seconds", type=float, default=None, help=f"per run ({defaults.seconds.describe()})")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"at most per run ({defaults.requests.describe()})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"{defaults.rounds_help} ({defaults.rounds.describe()})")


def add_model_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """Add ``--model``: the base model the server under test loads."""
    parser.add_argument("--model", default=default, help=MODEL_HELP)


@dataclass(frozen=True)
class LoadOptions:
    """The load options of one run: the flags given, else the command's defaults for its mode."""

    quick: bool
    levels: list[int]
    seconds: float
    requests: int
    rounds: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, defaults: LoadDefaults) -> "LoadOptions":
        """Resolve the flags of :func:`add_load_arguments` (and ``--quick``) against ``defaults``."""
        quick = bool(getattr(args, "quick", False))
        # ``or``, not ``is None``: a 0 also means "the default", as these commands always had it.
        return cls(quick=quick,
                   levels=list(args.concurrency or defaults.levels.pick(quick)),
                   seconds=args.seconds or defaults.seconds.pick(quick),
                   requests=args.requests or defaults.requests.pick(quick),
                   rounds=args.rounds or defaults.rounds.pick(quick))

    def settle_requests(self) -> int:
        """Requests per round of the warm-up that settles a server before timing, sent at the highest
        level (:func:`qswap.bench.fixtures.warm_until_settled`): enough for every batch shape that
        level makes to come up."""
        return 8 if self.quick else max(64, 8 * max(self.levels))

    def run(self, port: int, make_request: "Callable[[int], Request] | Sequence[Request]", concurrency: int,
            **kwargs: Any) -> "LoadResult":
        """One measured run on ``LOAD_HOST:port``: at most ``requests`` requests or ``seconds``.

        ``kwargs`` go to :func:`qswap.bench.loadgen.run_load` (``keep_bodies``, ...).
        """
        from qswap.bench.loadgen import run_load_sync
        return run_load_sync(LOAD_HOST, port, make_request, concurrency=concurrency,
                             max_requests=self.requests, duration_s=self.seconds, **kwargs)


def warm_up(port: int, make_request: "Callable[[int], Request] | Sequence[Request]", *, concurrency: int = 4,
            requests: int = 64, duration_s: float = 30.0) -> "LoadResult":
    """Unmeasured load before timing (adapters loaded, code paths run); the result is for checks only."""
    from qswap.bench.loadgen import run_load_sync
    return run_load_sync(LOAD_HOST, port, make_request, concurrency=concurrency, max_requests=requests,
                         duration_s=duration_s)


@dataclass
class RunDirs:
    """Where one run writes: its result directory, :class:`ResultWriter`, and a scratch ``tmp/``.

    ``tmp/`` holds what servers under test need (state directory, logs). It is kept after a
    ``--quick`` run, to read the logs, and removed after a full one.
    """

    name: str
    quick: bool
    out: Path
    tmp: Path
    writer: ResultWriter

    @classmethod
    def create(cls, name: str, quick: bool, out: Path | None) -> "RunDirs":
        """Resolve the result directory (:func:`results_dir_for`), start its writer, make ``tmp/``."""
        d = results_dir_for(name, quick, out)
        writer = ResultWriter(name, d)
        tmp = d / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return cls(name, quick, d, tmp, writer)

    def clean_scratch(self) -> None:
        """Remove ``tmp/`` after a full run (kept after ``--quick``)."""
        if not self.quick:
            shutil.rmtree(self.tmp, ignore_errors=True)


def load_point(r: "LoadResult") -> dict[str, Any]:
    """One measured run: QPS, latency percentiles, failures, the load average when it ended."""
    from qswap.bench.provenance import loadavg
    from qswap.bench.stats import summarize
    lat = summarize(r.latencies_ms())
    return {"qps": r.qps, "p50_ms": lat["p50"], "p99_ms": lat["p99"], "ok": len(r.ok), "failed": r.failed,
            "errors": r.errors(), "seconds": r.elapsed_s, "loadavg": loadavg()}
