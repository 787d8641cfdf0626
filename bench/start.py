"""``qswap bench start``: what a server start costs on a warm state dir, code versions side by side.

Each arm is a git revision of qswap (``--arm LABEL=REV``; ``.`` is the installed working tree).
A revision is checked out of git into a folder laid out as the installed package (the
``package-dir`` mapping of its ``pyproject.toml``) and run with that folder first on
``PYTHONPATH``, under the same interpreter and packages as this one. Every arm serves the same
``QSWAP_DATA_DIR`` (the bundled model converted, the demo index, the server's state dir with
its cached ONNX exports and base layout): ``qswap serve`` with no index or model options, as a
user's restart. Each arm starts once unmeasured (bytecode compiled, its caches written), then
the arms alternate over ``--rounds``: launch to ``/readyz`` 200 (polled every 10 ms), then one
search (the first forward pass on the served runtime), then a clean stop.

``--cli`` measures command-line processes instead (results ``cli_start``): on the same warm data
dir and the demo corpus (``qswap demo``), each arm builds an index once unmeasured, then the arms
alternate over ``--rounds``: ``qswap index search`` of one query on its index, and ``qswap index
build`` of the corpus into a new folder, each timed from launch to exit (wall) with the child's
CPU time (user + system, from ``wait4``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.provenance import loadavg
from qswap.bench.results import ResultWriter, md_table, results_dir_for
from qswap.bench.revisions import arm_command, parse_arms
from qswap.errors import InvalidInputError

QUERY = "chess engine with a graphical board"
POLL_S = 0.01


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arm", action="append", default=None, metavar="LABEL=REV",
                   help="a code version to start: a git revision, or '.' for the installed working tree "
                        "(repeat; default: this=.)")
    p.add_argument("--rounds", type=int, default=3, help="measured starts per arm, arms alternating")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="QSWAP_DATA_DIR the servers share (default: a fresh one under the results tmp/)")
    p.add_argument("--cli", action="store_true",
                   help="time CLI processes (index search, index build) instead of server starts: results cli_start")


def _one_start(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    port = free_port()
    srv = ServerProcess([*cmd, "serve", "--host", "127.0.0.1", "--port", str(port), "--insecure",
                         "--log-format", "text"], port, ready_path="/readyz", log_path=log, env=env, poll_s=POLL_S)
    with srv:
        t0 = time.perf_counter()
        status, body = http_json("POST", srv.url("/v1/search"), {"query": QUERY, "k": 3})
        search_s = time.perf_counter() - t0
        if status != 200 or not body["results"][0]["hits"]:
            raise InvalidInputError(f"search after start answered {status}: {body}", f"see {log}")
    assert srv.start_seconds is not None
    return {"ready_s": srv.start_seconds, "search_s": search_s, "total_s": srv.start_seconds + search_s}


def _one_cli(cmd: list[str], env: dict[str, str], argv: list[str], cwd: Path, log: Path) -> dict[str, float]:
    """One CLI process: launch to exit (wall s) and its CPU time (user + system s)."""
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        proc = subprocess.Popen([*cmd, *argv], cwd=cwd, env={**os.environ, **env}, stdout=f, stderr=f)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise InvalidInputError(f"{' '.join(argv[:2])} exited {proc.returncode}", f"see {log}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def _cli_rounds(cmds: dict[str, tuple[list[str], dict[str, str]]], rounds: int, work: Path) -> list[dict[str, Any]]:
    """Warm each arm (its own index of the demo corpus), then time search and build, arms alternating."""
    first = next(iter(cmds.values()))
    _one_cli(*first, ["demo"], work, work / "demo.log")   # corpus.jsonl in work/
    for label in cmds:
        print(f"cli: warming {label}", file=sys.stderr, flush=True)
        _one_cli(*cmds[label], ["index", "build", "corpus.jsonl", "--out", f"idx-{label}", "--no-progress"], work,
                 work / f"{label}-warm.log")
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for label in (list(cmds) if r % 2 == 0 else list(reversed(cmds))):
            for command, argv in (("index search", ["index", "search", f"idx-{label}", QUERY, "-k", "3"]),
                                  ("index build", ["index", "build", "corpus.jsonl", "--out", f"b-{label}-{r}",
                                                   "--no-progress"])):
                one = _one_cli(*cmds[label], argv, work, work / f"{label}-{r}.log")
                runs.append({"arm": label, "round": r, "command": command, **one, "loadavg": loadavg()})
                print(f"cli: round {r} {label} {command}: {one['wall_s']:.2f} s wall, {one['cpu_s']:.2f} s CPU",
                      file=sys.stderr, flush=True)
            shutil.rmtree(work / f"b-{label}-{r}", ignore_errors=True)
    return runs


def _cli_report(runs: list[dict[str, Any]], revs: dict[str, str], rounds: int) -> tuple[dict[str, Any], str]:
    commands = list(dict.fromkeys(x["command"] for x in runs))
    median = {label: {c: {k: statistics.median(x[k] for x in runs if x["arm"] == label and x["command"] == c)
                          for k in ("wall_s", "cpu_s")} for c in commands} for label in revs}
    rows = [[c, label, revs[label], f"{m[c]['wall_s']:.2f}", f"{m[c]['cpu_s']:.2f}",
             " / ".join(f"{x['wall_s']:.2f}" for x in runs if x["arm"] == label and x["command"] == c)]
            for c in commands for label, m in median.items()]
    md = (f"`qswap index search` (one query, k 3) and `qswap index build` (the 400-document demo corpus) with "
          f"the bundled model on a warm `QSWAP_DATA_DIR`, each a fresh process; {rounds} rounds, arms alternating. "
          "CPU: the process's user + system time.\n\n"
          + md_table(["command", "arm", "revision", "wall s (median)", "CPU s (median)", "wall s per round"], rows))
    return {"arms": revs, "rounds": rounds, "runs": runs, "median": median}, md


def run(args: argparse.Namespace) -> int:
    name = "cli_start" if args.cli else "start"
    out = results_dir_for(name, args.quick, args.out)
    writer = ResultWriter(name, out)
    rounds = 1 if args.quick else args.rounds
    arms = parse_arms(args.arm)
    work = Path(tempfile.mkdtemp(prefix="qswap-bench-start-"))
    try:
        data = args.data_dir or (out / "tmp" / "data")
        env = {"QSWAP_DATA_DIR": str(data)}
        cmds: dict[str, tuple[list[str], dict[str, str]]] = {}
        for label, rev in arms:
            cmd, extra = arm_command(label, rev, work)
            cmds[label] = (cmd, {**env, **extra})
        revs = {label: rev for label, rev in arms}
        if args.cli:
            res, md = _cli_report(_cli_rounds(cmds, rounds, work), revs, rounds)
            print(f"cli: results in {writer.write(res, md)}", file=sys.stderr)
            return 0
        for label in cmds:   # unmeasured: converts the model and builds the demo index on a new data dir
            print(f"start: warming {label}", file=sys.stderr, flush=True)
            _one_start(*cmds[label], work / f"{label}-warm.log")
        starts: list[dict[str, Any]] = []
        for r in range(rounds):
            for label in (list(cmds) if r % 2 == 0 else list(reversed(cmds))):
                one = _one_start(*cmds[label], work / f"{label}-{r}.log")
                starts.append({"arm": label, "round": r, **one, "loadavg": loadavg()})
                print(f"start: round {r} {label}: ready {one['ready_s']:.2f} s, search {1000 * one['search_s']:.0f} ms",
                      file=sys.stderr, flush=True)
        summary = {label: {k: statistics.median(s[k] for s in starts if s["arm"] == label)
                           for k in ("ready_s", "search_s", "total_s")} for label in cmds}
        res = {"arms": revs, "rounds": rounds, "poll_s": POLL_S, "starts": starts, "median": summary}
        rows = [[label, revs[label], f"{m['ready_s']:.2f}", f"{1000 * m['search_s']:.0f}", f"{m['total_s']:.2f}",
                 " / ".join(f"{s['ready_s']:.2f}" for s in starts if s["arm"] == label)]
                for label, m in summary.items()]
        md = (f"`qswap serve` (the bundled model over the demo index, `--insecure`) on a warm `QSWAP_DATA_DIR`, "
              f"{rounds} rounds, arms alternating; `/readyz` polled every {1000 * POLL_S:.0f} ms.\n\n"
              + md_table(["arm", "revision", "ready s (median)", "first search ms", "ready + search s",
                          "ready s per round"], rows))
        print(f"start: results in {writer.write(res, md)}", file=sys.stderr)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
