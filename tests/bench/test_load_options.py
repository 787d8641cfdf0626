"""Shared load-test options of ``qswap bench serving|baseline|hotswap`` and their run directories."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from qswap.bench import hotswap, load_options, naive_baseline, results, serving
from qswap.bench.cli import add_common_arguments
from qswap.bench.load_options import LOAD_HOST, ByMode, LoadOptions, RunDirs, parse_levels

from ..local_http import http_server

COMMANDS = {"serving": serving, "baseline": naive_baseline, "hotswap": hotswap}


def parser_for(name: str) -> argparse.ArgumentParser:
    """The command's parser as ``qswap bench <name>`` builds it (common options + its own)."""
    p = argparse.ArgumentParser(prog=f"qswap bench {name}")
    add_common_arguments(p, name)
    COMMANDS[name].add_arguments(p)
    return p


def options(name: str, module: ModuleType, *argv: str) -> LoadOptions:
    return LoadOptions.from_args(parser_for(name).parse_args(list(argv)), module.LOAD)


def test_each_command_keeps_its_flags():
    flags = {n: [a.option_strings[-1] for a in parser_for(n)._actions] for n in COMMANDS}
    assert flags["serving"] == ["--help", "--quick", "--out", "--concurrency", "--seconds", "--requests", "--rounds",
                                "--model", "--backend", "--query-precision", "--embeddings", "--ray", "--replicas",
                                "--no-mux", "--mux-only", "--autoscale", "--autoscale-only", "--hop"]
    assert flags["baseline"] == ["--help", "--quick", "--out", "--concurrency", "--seconds", "--requests", "--rounds",
                                 "--domains", "--naive-runtime", "--model"]
    assert flags["hotswap"] == ["--help", "--quick", "--out", "--swaps", "--concurrency", "--pause", "--model"]


@pytest.mark.parametrize("name, module, full, quick", [
    ("serving", serving, LoadOptions(False, [1, 2, 4, 8, 16, 32, 64], 8.0, 3000, 2),
     LoadOptions(True, [1, 4], 2.0, 40, 1)),
    ("baseline", naive_baseline, LoadOptions(False, [1, 8, 32], 8.0, 2000, 3),
     LoadOptions(True, [1, 4], 2.0, 30, 1)),
])
def test_defaults_per_command_and_mode(name, module, full, quick):
    assert options(name, module) == full
    assert options(name, module, "--quick") == quick


def test_serving_and_baseline_defaults_differ():
    s, b = options("serving", serving), options("baseline", naive_baseline)
    assert s.levels != b.levels and s.requests != b.requests and s.rounds != b.rounds
    assert s.seconds == b.seconds


@pytest.mark.parametrize("quick", [False, True])
def test_flags_override_defaults(quick):
    argv = ["--concurrency", "2,6", "--seconds", "1.5", "--requests", "7", "--rounds", "4"]
    got = options("baseline", naive_baseline, *argv, *(["--quick"] if quick else []))
    assert got == LoadOptions(quick, [2, 6], 1.5, 7, 4)


def test_zero_still_means_default():
    # Kept from before the refactor: the commands resolved each flag with ``or``.
    got = options("serving", serving, "--seconds", "0", "--requests", "0", "--rounds", "0")
    assert (got.seconds, got.requests, got.rounds) == (8.0, 3000, 2)


def test_bad_levels_are_a_usage_error(capsys):
    assert parse_levels("3,1,16") == [3, 1, 16]
    with pytest.raises(SystemExit) as e:
        parser_for("serving").parse_args(["--concurrency", "1,x"])
    assert e.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize("name, expected", [
    ("serving", ["comma-separated levels (default 1,2,4,8,16,32,64; quick 1,4)", "per run (default 8; quick 2)",
                 "at most per run (default 3000; quick 40)", "A/B rounds per level (default 2; quick 1)",
                 "base model (bundled name or directory)"]),
    ("baseline", ["comma-separated levels (default 1,8,32; quick 1,4)", "at most per run (default 2000; quick 30)",
                  "alternating rounds per level (default 3; quick 1)", "domains (default 8; quick 2)"]),
    ("hotswap", ["versions swapped in (default 20; quick 3)", "load connections (default 8; quick 2)",
                 "seconds of plain load between swaps (default 1; quick 0.3)"]),
])
def test_help_quotes_the_command_defaults(name, expected):
    text = " ".join(parser_for(name).format_help().split())
    for phrase in expected:
        assert phrase in text


def test_model_default_is_the_bundled_model():
    for name in COMMANDS:
        assert parser_for(name).parse_args([]).model == serving.MODEL


def test_by_mode():
    m = ByMode(1.0, 0.3)
    assert m.pick(False) == 1.0 and m.pick(True) == 0.3
    assert m.describe() == "default 1; quick 0.3"
    assert ByMode((1, 8, 32), (4,)).describe() == "default 1,8,32; quick 4"
    assert hotswap.SWAPS.pick(True) == 3 and naive_baseline.DOMAINS.pick(False) == naive_baseline.N_DOMAINS


@pytest.fixture
def ok_server():
    with http_server(LOAD_HOST, {("POST", "*"): lambda: b'{"ok": true}'}) as port:
        yield port


def test_run_and_warm_up_are_bounded_by_the_options(ok_server):
    from qswap.bench.loadgen import Request
    req = [Request.post_json("/x", {"q": 1})]
    opts = LoadOptions(True, [2], 10.0, 5, 1)
    res = opts.run(ok_server, req, 2, keep_bodies=True)
    assert res.concurrency == 2 and res.sent == 5 and len(res.ok) == 5 and res.stopped_by == "count"
    assert all(s.body == b'{"ok": true}' for s in res.samples)
    w = load_options.warm_up(ok_server, req, concurrency=1, requests=3)
    assert w.sent == 3 and w.failed == 0


@pytest.mark.parametrize("quick", [False, True])
def test_run_dirs(tmp_path, monkeypatch, quick):
    monkeypatch.setattr(results, "default_results_dir", lambda name: tmp_path / "results" / name)
    d = RunDirs.create("demo", quick, None)
    expected = tmp_path / "results" / "demo" / ("tmp/quick" if quick else "")
    assert d.out == expected and d.writer.out_dir == expected and d.tmp == expected / "tmp"
    assert d.tmp.is_dir()
    (d.tmp / "server.log").write_text("x")
    d.clean_scratch()
    # Scratch (server state, logs) is kept after a smoke run only.
    assert d.tmp.is_dir() is quick and d.out.is_dir()
    explicit = RunDirs.create("demo", quick, tmp_path / "mine")
    assert explicit.out == tmp_path / "mine" and explicit.tmp.is_dir()
