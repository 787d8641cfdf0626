"""Packed (padding-free) forward against padded calls, on the shared graph of one base.

``qswap bench packed-forward``: exports the shared
graph and its packed form (:mod:`qswap.encoders.runtime.packed_export`), with LoRA inputs on
every Linear (rank 0 bound: the base) and without any (``lora=[]``), and times, on batches of
real query lengths (the Debian bench queries with the model's query prefix), three arms per
graph, alternated batch by batch in a rotating order:

- ``padded``: one call, every row padded to the batch's longest;
- ``splits``: rows sorted by length and cut into calls as the runtime cuts them
  (:func:`qswap.encoders.embedding.padded_splits`, ``CALL_TOKENS``);
- ``packed``: one call of the packed graph on the real tokens.

Adapter inputs are bound once per session (``IOBinding``), as the runtime binds them. Each arm's
answers are checked against the torch base row by row (cosine). Writes ``results.json`` and
``README.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ARMS = ("padded", "splits", "packed")


def _session(path: Path, threads: int) -> Any:
    from qswap.encoders.runtime.onnx import make_session

    return make_session(path, threads, ["CPUExecutionProvider"])


def _binding(session: Any, values: dict[str, Any]) -> Any:
    b = session.io_binding()
    for name, v in values.items():
        b.bind_ortvalue_input(name, v)
    return b


def _run(session: Any, binding: Any, feed: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    for name, v in feed.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(v))
    binding.bind_output("embedding")
    session.run_with_iobinding(binding)
    out = binding.copy_outputs_to_cpu()[0]
    binding.clear_binding_outputs()
    return out


def arms(table: np.ndarray, pad: int, pooling: str, start: int) -> dict[str, Callable[..., np.ndarray]]:
    """Each arm as ``f(session, binding, rows) -> (n, d)`` embeddings in row order."""
    from qswap.encoders.embedding import padded_splits
    from qswap.encoders.runtime.onnx import CALL_TOKENS
    from qswap.encoders.runtime.packing import packing

    def padded_call(session: Any, binding: Any, rows: list[np.ndarray]) -> np.ndarray:
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), pad, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        return _run(session, binding, {"inputs_embeds": np.take(table, ids, axis=0), "attention_mask": mask})

    def splits(session: Any, binding: Any, rows: list[np.ndarray]) -> np.ndarray:
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = np.empty((len(rows), table.shape[1]), dtype=np.float32)
        for lo, hi in padded_splits([len(rows[i]) for i in order], 64, CALL_TOKENS):
            idx = order[lo:hi]
            out[idx] = padded_call(session, binding, [rows[i] for i in idx])
        return out

    def packed(session: Any, binding: Any, rows: list[np.ndarray]) -> np.ndarray:
        feed = packing([len(r) for r in rows], pooling, start)
        feed["inputs_embeds"] = np.take(table, np.concatenate(rows), axis=0)[None]
        return _run(session, binding, feed)

    return {"padded": padded_call, "splits": splits, "packed": packed}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (``--quick`` and ``--out`` are common to every benchmark)."""
    p.add_argument("--batches", default="1,4,8,16,32", help="rows per batch (default: %(default)s)")
    p.add_argument("--threads", default="2,1", help="intra-op threads, each a pass (default: %(default)s)")
    p.add_argument("--draws", type=int, default=10, help="random batches per size and round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the draws (default: %(default)s)")
    p.add_argument("--graphs", default="lora,plain",
                   help="lora: LoRA inputs on every Linear; plain: none (default: %(default)s)")


def run(args: argparse.Namespace) -> None:
    """Run the benchmark (module docstring)."""
    if args.quick:
        args.batches, args.threads, args.draws, args.rounds, args.graphs = "4", "1", 2, 1, "plain"
    import torch
    from qswap.bench.results import ResultWriter, results_dir_for
    from qswap.bench.fixtures import load_space_base, load_workload
    from qswap.encoders.embedding import pad_id
    from qswap.encoders.runtime.onnx_export import build_module
    from qswap.encoders.runtime.packed_export import export_packed, first_position
    from qswap.encoders.runtime.shared_export import export_shared, find_slots, ort_input

    writer = ResultWriter("packed_forward", results_dir_for("packed_forward", args.quick, args.out))
    base = load_space_base()
    table = base.word_embeddings().detach().float().numpy()
    tok, prefix = base.tokenizer, base.spec.query_prefix
    queries = load_workload(False).queries
    encs = tok.encode_batch([prefix + q for q in queries])
    rows_all = [np.asarray(e.ids[:sum(e.attention_mask)], dtype=np.int64) for e in encs]
    lengths = np.array([len(r) for r in rows_all])
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    draws = {b: [rng.choice(len(rows_all), b, replace=False) for _ in range(args.draws)] for b in batches}
    # torch reference for every row drawn, each row alone (no padding)
    used = sorted({int(i) for ds in draws.values() for d in ds for i in d})
    module = build_module(base, {})
    ref: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for i in used:
            e = torch.from_numpy(table[rows_all[i]][None])
            ref[i] = module(e, torch.ones((1, len(rows_all[i])), dtype=torch.int64))[0].numpy()
    start = first_position(module)
    fns = arms(table, pad_id(tok), base.spec.pooling, start)
    results: dict[str, Any] = {"lengths": {"mean": float(lengths.mean()), "p10": float(np.percentile(lengths, 10)),
                                           "p90": float(np.percentile(lengths, 90)),
                                           "p99": float(np.percentile(lengths, 99))}, "points": []}
    with tempfile.TemporaryDirectory() as tmp:
        graphs: dict[str, dict[str, Any]] = {}
        for g in args.graphs.split(","):
            lora = None if g == "lora" else []
            slots = find_slots(base.layout) if lora is None else find_slots(base.layout).only(lora)
            values = {n: ort_input(t) for n, t in slots.base_inputs(base).items()}
            fs = export_shared(base, Path(tmp) / f"s-{g}", lora=lora)
            fp = export_packed(base, Path(tmp) / f"p-{g}", lora=lora)
            graphs[g] = {"values": values, "shared": Path(tmp) / f"s-{g}" / "shared.onnx",
                         "packed": Path(tmp) / f"p-{g}" / "packed.onnx"}
            results.setdefault("exports", {})[g] = {"shared": fs, "packed": fp}
        for g, info in graphs.items():
            for t in threads:
                sess = {"shared": _session(info["shared"], t), "packed": _session(info["packed"], t)}
                binds = {k: _binding(s, info["values"]) for k, s in sess.items()}
                for b in batches:
                    secs = {a: [] for a in ARMS}
                    cos = {a: 1.0 for a in ARMS}
                    for a in ARMS:   # warm-up: every shape once
                        k = "packed" if a == "packed" else "shared"
                        for d in draws[b][:2]:
                            fns[a](sess[k], binds[k], [rows_all[i] for i in d])
                    for r in range(args.rounds):
                        for j, d in enumerate(draws[b]):
                            rows = [rows_all[i] for i in d]
                            order = ARMS[(r + j) % 3:] + ARMS[:(r + j) % 3]   # rotate who goes first
                            for a in order:
                                k = "packed" if a == "packed" else "shared"
                                t0 = time.perf_counter()
                                out = fns[a](sess[k], binds[k], rows)
                                secs[a].append(time.perf_counter() - t0)
                                want = np.stack([ref[int(i)] for i in d])
                                c = (out * want).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(want, axis=1)
                                cos[a] = min(cos[a], float(c.min()))
                    real = sum(int(lengths[i]) for d in draws[b] for i in d)
                    padded = sum(len(d) * int(lengths[d].max()) for d in draws[b])
                    point = {"graph": g, "threads": t, "batch": b, "padding_factor": round(padded / real, 3),
                             **{f"{a}_rows_per_s": round(b * len(secs[a]) / sum(secs[a]), 1) for a in ARMS},
                             **{f"{a}_min_cosine": cos[a] for a in ARMS}}
                    point["packed_over_splits"] = round(point["packed_rows_per_s"] / point["splits_rows_per_s"], 3)
                    point["load"] = open("/proc/loadavg").read().split()[0]
                    point["packed_over_padded"] = round(point["packed_rows_per_s"] / point["padded_rows_per_s"], 3)
                    results["points"].append(point)
                    print(json.dumps(point), flush=True)
                    # after every point: a run cut short keeps what it measured
                    writer.write(results, summary(results))


def summary(results: dict[str, Any]) -> str:
    """The README body: the workload, the arms, and every point."""
    n = results["lengths"]
    return (f"Batches drawn from the Debian bench queries with the query prefix: {n['mean']:.1f} tokens on average "
            f"(p10 {n['p10']:.0f}, p90 {n['p90']:.0f}, p99 {n['p99']:.0f}). Rows per second of each arm, "
            "alternated batch by batch (module docstring of `qswap.bench.packed_forward`): `padded`, one call "
            "padded to the longest row; `splits`, the padded calls the runtime made before (rows sorted, cut "
            "by `padded_splits` with `CALL_TOKENS`); `packed`, one call of the packed graph. Graph `lora`: LoRA "
            "inputs on every Linear, rank 0 bound (the shared graph); `plain`: no LoRA inputs. `load`: the "
            "1-minute load average after the point.\n\n" + table(results))


def table(results: dict[str, Any]) -> str:
    """The points as a markdown table: rows/s per arm, packed over the runtime's padded splits."""
    lines = ["| graph | threads | batch | padded tokens / real | padded | splits | packed | packed / splits "
             "| min cosine to torch (packed) | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        lines.append(f"| {p['graph']} | {p['threads']} | {p['batch']} | {p['padding_factor']} | "
                     f"{p['padded_rows_per_s']} | {p['splits_rows_per_s']} | {p['packed_rows_per_s']} | "
                     f"**{p['packed_over_splits']}** | {p['packed_min_cosine']:.7f} | {p['load']} |")
    return "\n".join(lines) + "\n"

